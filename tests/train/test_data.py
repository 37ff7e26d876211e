"""Synthetic tasks checked by reading the sequences back; text windows checked against the token stream."""

from __future__ import annotations

import pytest
import torch

from k3.train.data import IGNORE, MQAR, Copying, TextFile, answer_accuracy


def test_mqar_every_answer_is_the_value_of_its_key_in_the_context() -> None:
    task = MQAR(vocab_size=64, seq_len=63, batch_size=16, num_kv_pairs=6, seed=3)
    inputs, labels = task.batch(5)
    assert inputs.shape == labels.shape == (16, 63)
    half = 32
    for b in range(16):
        context = inputs[b, :12].tolist()
        memory = dict(zip(context[0::2], context[1::2], strict=True))
        assert len(memory) == 6 and all(1 <= key < half for key in memory)  # distinct keys, lower half
        assert all(value >= half for value in memory.values())
        answered = (labels[b] != IGNORE).nonzero().flatten().tolist()
        assert len(answered) == 6  # every key is queried exactly once
        asked = [int(inputs[b, i]) for i in answered]
        assert sorted(asked) == sorted(memory)
        for i in answered:
            assert i >= 12 and int(labels[b, i]) == memory[int(inputs[b, i])]
            if i + 1 < 63:  # the value follows its key in the input too
                assert int(inputs[b, i + 1]) == int(labels[b, i])


def test_mqar_queries_follow_the_power_law() -> None:
    """Zoology's power law puts queries near the context far more often than uniform placement would."""
    task = MQAR(vocab_size=64, seq_len=255, batch_size=64, num_kv_pairs=4, seed=0)
    _, labels = task.batch(0)
    positions = (labels != IGNORE).nonzero()[:, 1].float()
    uniform_mean = 8 + (255 - 8) / 2
    assert positions.mean() < 0.7 * uniform_mean


def test_batches_are_a_pure_function_of_seed_and_index() -> None:
    a = MQAR(vocab_size=64, seq_len=31, batch_size=4, num_kv_pairs=4, seed=1)
    b = MQAR(vocab_size=64, seq_len=31, batch_size=4, num_kv_pairs=4, seed=1)
    assert torch.equal(a.batch(7)[0], b.batch(7)[0]) and torch.equal(a.batch(7)[1], b.batch(7)[1])
    assert not torch.equal(a.batch(7)[0], a.batch(8)[0])
    held_out = MQAR(vocab_size=64, seq_len=31, batch_size=4, num_kv_pairs=4, seed=1, stream=1)
    assert not torch.equal(a.batch(7)[0], held_out.batch(7)[0])


def test_mqar_rejects_impossible_shapes() -> None:
    with pytest.raises(ValueError, match="too short"):
        MQAR(vocab_size=64, seq_len=10, batch_size=1, num_kv_pairs=8)
    with pytest.raises(ValueError, match="too small"):
        MQAR(vocab_size=8, seq_len=64, batch_size=1, num_kv_pairs=8)


def test_copying_labels_are_the_source_after_the_separator() -> None:
    task = Copying(vocab_size=50, seq_len=21, batch_size=3, seed=2)
    inputs, labels = task.batch(0)
    for b in range(3):
        source = inputs[b, :10]
        assert int(inputs[b, 10]) == 0  # separator
        assert torch.equal(labels[b, 10:20], source)
        assert (labels[b, :10] == IGNORE).all() and (labels[b, 20:] == IGNORE).all()
        assert torch.equal(inputs[b, 11:21], source)


def test_text_file_windows_are_consecutive_tokens(tmp_path) -> None:
    from k3.tokenizer.build import builtin_tokenizer

    tokenizer = builtin_tokenizer(1024)
    path = tmp_path / "corpus.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    ids = tokenizer.encode(path.read_text())
    data = TextFile(path, tokenizer, seq_len=16, batch_size=4, vocab_size=1024, seed=0)
    inputs, labels = data.batch(3)
    assert inputs.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    stream = torch.tensor(ids)
    for row in inputs:
        starts = [s for s in range(len(ids) - 16) if torch.equal(stream[s : s + 16], row)]
        assert starts, "a window that is not a slice of the token stream"
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        TextFile(path, tokenizer, seq_len=16, batch_size=4, vocab_size=100)


def test_answer_accuracy_counts_only_answer_positions() -> None:
    labels = torch.tensor([[IGNORE, 2, IGNORE, 1]])
    logits = torch.zeros(1, 4, 3)
    logits[0, 1, 2] = 1.0  # right
    logits[0, 3, 0] = 1.0  # wrong
    logits[0, 0, 1] = 5.0  # ignored position
    assert answer_accuracy(logits, labels) == 0.5
