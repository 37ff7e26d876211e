"""Kimi K3's vision path (spec: ../shared/spec/K3-vision.md): pixels -> MoonViT3d tower -> 2x2 merge ->
projector -> rows of the text model's width.

Modules, one concept each: `config` (VisionConfig, the published `vision_config`), `preprocess` (Pillow:
the navit resize rule, alpha fill, padding, patches), `prompt` (media tokens, expansion), `position`
(position grid, time table, 2D RoPE), `tower` (patch embedding, encoder blocks), `projector` (sd2_tpool
merge, patchmergerv2), `naive` (a slow loop-by-loop reference of the tower and projector), `commands`
(`k3 vision preprocess`). This room imports no other k3 room but `errors`: the config and every room
above may use it.
"""
