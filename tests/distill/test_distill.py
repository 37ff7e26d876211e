"""Distillation loss and scoring: a teacher equal to the student leaves SGD's weights bitwise unchanged,
the loss gradient against the analytic policy-gradient form (float64), the full-vocabulary reverse KL
against a brute-force sum, each sample scored by its own teacher only (counted), vocabulary mismatches."""

import copy
import math

import pytest
import torch

from k3.config import K3Config
from k3.distill.config import DistillConfig, DistillError
from k3.distill.losses import (
    advantages,
    distill_loss,
    forward_kl_full,
    full_vocab_kl,
    gkd_loss,
    reverse_kl_full,
    sampled_reverse_kl,
)
from k3.distill.teachers import (
    Scores,
    TeacherSpec,
    assign_domains,
    average_weights,
    check_vocabularies,
    parse_teacher,
    score,
    vocabulary_of,
)
from k3.model import K3ForCausalLM
from k3.rl.policy import pack, token_logprobs
from k3.rl.rollout import Trajectory


def _tiny(seed: int) -> K3ForCausalLM:
    return K3ForCausalLM.from_config(K3Config.from_pretrained("tiny"), seed=seed, quantized_experts=False)


def _trajectories() -> list[Trajectory]:
    """Unequal prompts and answers (planted ids), as the engine would return them."""
    specs = [
        ([49, 43, 50, 61], [51, 52, 769]),
        ([115, 111, 61], [49, 769]),
        ([97, 51, 63, 97, 61], [51, 769]),
        ([50, 43, 50, 61], [52, 48, 49, 769]),
    ]
    out = []
    for g, (prompt, tokens) in enumerate(specs):
        out.append(Trajectory(g, 0, prompt, tokens, [-1.0] * len(tokens), [0] * len(tokens), "stop", 1))
    return out


def test_teacher_equal_to_student_zero_advantage_and_sgd_leaves_weights_bitwise():
    student = _tiny(0)
    teacher = copy.deepcopy(student).eval()
    trajs = _trajectories()
    teacher_of = ["a", "b", "a", "b"]  # two "teachers", both equal to the student
    scores = score(student, {"a": teacher, "b": teacher}, teacher_of, trajs, temperature=1.0)
    adv = advantages(scores)
    assert scores.mask.sum() == sum(len(t.tokens) for t in trajs)
    assert torch.equal(adv, torch.zeros_like(adv))
    before = {k: v.clone() for k, v in student.state_dict().items()}
    for lr in (1e-3, 1.0, 1e6):
        opt = torch.optim.SGD(student.parameters(), lr=lr)
        packed = pack(trajs)
        behaviour = torch.tensor([[-1.0] * packed.mask.shape[1]] * len(trajs))
        loss = distill_loss(token_logprobs(student, packed, 1.0), behaviour, adv, packed.mask)
        loss.backward()
        assert any(p.grad is not None for p in student.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
    after = student.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # a different teacher: advantages are not zero and the same update moves the weights
    scores = score(student, {"a": _tiny(1).eval(), "b": teacher}, teacher_of, trajs, temperature=1.0)
    assert advantages(scores)[[0, 2]].abs().sum() > 0 and torch.equal(
        advantages(scores)[[1, 3]], torch.zeros(2, 4)
    )


def test_loss_gradient_equals_analytic_policy_gradient_float64():
    torch.manual_seed(0)
    N, T, V = 3, 5, 7
    logits = torch.randn(N, T, V, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (N, T))
    mask = torch.ones(N, T, dtype=torch.float64)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    behaviour = logp.detach() + torch.randn(N, T, dtype=torch.float64)  # some ratios outside [0.5, 1.5]
    adv = torch.randn(N, T, dtype=torch.float64)
    low, high = 0.5, 1.5
    distill_loss(logp, behaviour, adv, mask, low, high).backward()
    # analytic: grad_z log softmax(z)[x] = onehot(x) - softmax(z); w, A constants
    p = torch.softmax(logits.detach(), -1)
    onehot = torch.nn.functional.one_hot(targets, V).double()
    n = mask.sum()
    expected = torch.zeros_like(p)
    for i in range(N):
        for t in range(T):
            if mask[i, t]:
                w = min(max(math.exp(float(logp[i, t].detach() - behaviour[i, t])), low), high)
                expected[i, t] = -(w * float(adv[i, t]) / n) * (onehot[i, t] - p[i, t])
    assert torch.allclose(logits.grad, expected, atol=1e-12, rtol=0)
    assert not torch.equal(logits.grad, torch.zeros_like(logits.grad))


def test_full_vocabulary_reverse_kl_brute_force():
    student = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    teacher = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    brute = sum(float(q) * math.log(float(q) / float(p)) for q, p in zip(student, teacher, strict=True))
    got = reverse_kl_full(student.log()[None, None], teacher.log()[None, None])
    assert abs(float(got[0, 0]) - brute) < 1e-15
    assert abs(float(reverse_kl_full(teacher.log(), teacher.log()))) < 1e-15
    # the GKD loss differentiates through the student only, and its gradient vanishes at student == teacher
    z = teacher.log().clone().requires_grad_(True)
    t = teacher.log().clone().requires_grad_(True)
    kl = full_vocab_kl(torch.log_softmax(z, -1)[None, None], t[None, None])
    gkd_loss(kl, torch.ones(1, 1, dtype=torch.float64)).backward()
    assert t.grad is None and float(z.grad.abs().max()) < 1e-15
    # away from the teacher: d KL / d z_j = q_j (log q_j - log p_j - KL), q = softmax(z)
    z = torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    gkd_loss(
        full_vocab_kl(torch.log_softmax(z, -1)[None, None], teacher.log()[None, None]), torch.ones(1, 1)
    ).backward()
    q = torch.softmax(z.detach(), -1)
    kl = float((q * (q.log() - teacher.log())).sum())
    assert torch.allclose(z.grad, q * (q.log() - teacher.log() - kl), atol=1e-14, rtol=0)


def test_full_vocabulary_forward_kl_brute_force():
    """GKD beta = 0: KL(teacher || student) vs the sum over the vocabulary; its gradient in the student's
    logits is q - p (q = softmax(z), p the teacher), also where the student gives a token almost no mass."""
    student = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    teacher = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    brute = sum(float(p) * math.log(float(p) / float(q)) for q, p in zip(student, teacher, strict=True))
    got = forward_kl_full(student.log()[None, None], teacher.log()[None, None])
    assert abs(float(got[0, 0]) - brute) < 1e-15
    z = torch.tensor([0.3, -1.0, 2.0, -30.0], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 1, dtype=torch.float64)
    kl = full_vocab_kl(torch.log_softmax(z, -1)[None, None], teacher.log()[None, None], "forward")
    gkd_loss(kl, mask).backward()
    q = torch.softmax(z.detach(), -1)
    assert torch.allclose(z.grad, q - teacher, atol=1e-14, rtol=0)
    assert float(z.grad[3]) < -0.39  # the token the student nearly never samples is pulled up by ~p


class _Counting(torch.nn.Module):
    """A teacher that counts the rows and token ids it was fed."""

    def __init__(self, model):
        super().__init__()
        self.model, self.fed = model, []

    def forward(self, inputs):
        self.fed.append(inputs.clone())
        return self.model(inputs)


def test_mixed_domains_each_sample_scored_by_its_own_teacher_only():
    student = _tiny(0)
    teachers = {"arith": _Counting(_tiny(1)), "sort": _Counting(_tiny(2)), "recall": _Counting(_tiny(3))}
    trajs = _trajectories() + [Trajectory(9, 0, [120, 61], [55, 56, 57, 769], [0.0] * 4, [0] * 4, "stop", 1)]
    teacher_of = ["arith", "sort", "recall", "arith", "sort"]
    scores = score(student, teachers, teacher_of, trajs, temperature=1.0)
    for name, teacher in teachers.items():
        mine = [t for t, owner in zip(trajs, teacher_of, strict=True) if owner == name]
        assert len(teacher.fed) == 1  # one batched forward per teacher
        (fed,) = teacher.fed
        assert fed.shape[0] == len(mine)
        for row, t in zip(fed, mine, strict=True):
            seq = t.prompt + t.tokens[:-1]
            assert row[: len(seq)].tolist() == seq and not row[len(seq) :].any()
        assert scores.tokens_scored[name] == sum(len(t.tokens) for t in mine)
    # the scores are each teacher's own: recompute teacher by teacher, sample by sample
    for i, (t, owner) in enumerate(zip(trajs, teacher_of, strict=True)):
        alone = token_logprobs(teachers[owner].model, pack([t]), 1.0)[0]
        assert torch.allclose(scores.teacher[i, : len(t.tokens)], alone, atol=1e-5)
    kl = sampled_reverse_kl(scores, teacher_of)
    rows = [0, 3]
    expected = float(((scores.student - scores.teacher) * scores.mask)[rows].sum() / scores.mask[rows].sum())
    assert kl["arith"] == pytest.approx(expected)


def test_kl_discount_sums_each_samples_later_reverse_kl():
    """Against a loop over each sample's own tokens: token t's advantage is sum_{k >= t} g^(k - t) r_k,
    r the per-token log pi_teacher - log pi_student, over that sample's generated tokens only (padding,
    right of a shorter sample, adds nothing); g = 0 is the per-token advantage bit for bit."""
    g = torch.Generator().manual_seed(0)
    teacher, student = -torch.rand(3, 5, generator=g), -torch.rand(3, 5, generator=g)
    mask = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    s = Scores(teacher * mask, student * mask, mask)
    assert torch.equal(advantages(s, discount=0.0), advantages(s))
    for discount in (0.5, 1.0):
        adv = advantages(s, discount=discount)
        for b in range(3):
            n = int(mask[b].sum())
            r = [float(teacher[b, k] - student[b, k]) for k in range(n)]
            for t in range(5):
                want = sum(discount ** (k - t) * r[k] for k in range(t, n)) if t < n else 0.0
                assert float(adv[b, t]) == pytest.approx(want, abs=1e-6)
    with pytest.raises(DistillError, match="--kl-discount"):
        DistillConfig(teachers=["a=tiny:arithmetic"], kl_discount=1.5).check()
    with pytest.raises(DistillError, match="--kl-discount"):
        DistillConfig(
            teachers=["a=tiny:arithmetic"], kl_discount=1.0, full_vocab=True, divergence="forward"
        ).check()


def test_full_vocab_sequence_reverse_kl_is_unbiased_by_enumeration():
    """gkd_loss + distill_loss with future_kl_advantages (discount 1), on a tabular policy over every
    sequence of length 3 from 3 tokens, each weighted by its probability, has exactly the gradient of the
    whole sequence's expected reverse KL, sum_x q(x) sum_t KL(q(. | x<t) || p(. | x<t)), computed by
    enumeration (float64); the local term alone (discount 0) does not."""

    import itertools

    from k3.distill.losses import future_kl_advantages

    V, T = 3, 3
    prefixes = [p for t in range(T) for p in itertools.product(range(V), repeat=t)]
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(len(prefixes), V, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(len(prefixes), V, generator=g, dtype=torch.float64)
    row = {p: i for i, p in enumerate(prefixes)}
    seqs = list(itertools.product(range(V), repeat=T))

    def dists(table: torch.Tensor, x: tuple) -> torch.Tensor:  # [1, T, V] log-distributions along x
        return torch.log_softmax(torch.stack([table[row[x[:t]]] for t in range(T)]), -1)[None]

    def log_q(x: tuple) -> torch.Tensor:
        d = dists(theta, x)[0]
        return sum(d[t, x[t]] for t in range(T))

    exact = sum(
        log_q(x).exp() * reverse_kl_full(dists(theta, x), dists(teacher, x)).sum() for x in seqs
    )  # the whole sequence's expected reverse KL
    (want,) = torch.autograd.grad(exact, theta)
    mask = torch.ones(1, T, dtype=torch.float64)
    for discount, equal in ((1.0, True), (0.0, False)):
        estimate = 0.0
        for x in seqs:
            s_dist, t_dist = dists(theta, x), dists(teacher, x)
            logp = torch.stack([s_dist[0, t, x[t]] for t in range(T)])[None]  # [1, T]
            kl = full_vocab_kl(s_dist, t_dist)  # [1, T]
            future = future_kl_advantages(kl, mask, discount)
            loss = gkd_loss(kl, mask) + distill_loss(logp, logp.detach(), future, mask)
            estimate = estimate + log_q(x).exp().detach() * loss  # the expectation over samples
        (got,) = torch.autograd.grad(estimate, theta)
        assert torch.allclose(got * T, want, atol=1e-10) == equal  # the losses average over T tokens
    # a batch of two independent samples with the leave-one-out baseline: still exactly unbiased
    cache = {x: (dists(theta, x), dists(teacher, x)) for x in seqs}
    weight = {x: log_q(x).exp().detach() for x in seqs}
    estimate = 0.0
    for x, y in itertools.product(seqs, repeat=2):
        s_dist = torch.cat([cache[x][0], cache[y][0]])
        t_dist = torch.cat([cache[x][1], cache[y][1]])
        logp = torch.stack(
            [torch.stack([s_dist[b, t, z[t]] for t in range(T)]) for b, z in enumerate((x, y))]
        )
        both = torch.ones(2, T, dtype=torch.float64)
        kl = full_vocab_kl(s_dist, t_dist)  # [2, T]
        future = future_kl_advantages(kl, both, 1.0, baseline=True)
        loss = gkd_loss(kl, both) + distill_loss(logp, logp.detach(), future, both)
        estimate = estimate + weight[x] * weight[y] * loss
    (got,) = torch.autograd.grad(estimate, theta)
    assert torch.allclose(got * T, want, atol=1e-10)


def test_leave_one_out_mean_against_a_loop():
    from k3.distill.losses import leave_one_out_mean

    x = torch.tensor([[1.0, 2.0, 3.0], [5.0, 7.0, 0.0], [9.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0]])
    got = leave_one_out_mean(x, mask)
    for i in range(3):
        for t in range(3):
            others = [float(x[j, t]) for j in range(3) if j != i and mask[j, t]]
            want = sum(others) / len(others) if mask[i, t] and others else 0.0
            assert float(got[i, t]) == pytest.approx(want)
    with pytest.raises(DistillError, match="--kl-baseline"):
        DistillConfig(teachers=["a=tiny:arithmetic"], kl_discount=1.0, kl_baseline=True).check()


def test_length_norm_averages_each_samples_rest_against_a_loop():
    """MiniLLM's length normalization, against a loop over each sample's own tokens: the sampled advantage
    at t is sum_{k >= t} g^(k - t) r_k / sum_{k >= t} g^(k - t); the full-vocabulary future weight is the
    same over k > t of KL_k (0 at a sample's last token): future_kl_advantages, recovered from the
    gradient of distill_loss with it."""
    from k3.distill.losses import future_kl_advantages

    g = torch.Generator().manual_seed(1)
    teacher, student = -torch.rand(3, 5, generator=g), -torch.rand(3, 5, generator=g)
    mask = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    lengths = [int(n) for n in mask.sum(1)]
    s = Scores(teacher * mask, student * mask, mask)
    s_dist = torch.log_softmax(torch.randn(3, 5, 7, generator=g), -1)
    t_dist = torch.log_softmax(torch.randn(3, 5, 7, generator=g), -1)
    kl = reverse_kl_full(s_dist, t_dist)
    for discount in (0.5, 1.0):
        adv = advantages(s, discount=discount, length_norm=True)
        logp = torch.zeros(3, 5, requires_grad=True)  # the future weights come back as its gradient
        future = future_kl_advantages(kl, mask, discount, length_norm=True)
        distill_loss(logp, logp.detach(), future, mask).backward()
        weight = -logp.grad * mask.sum()  # distill_loss: -(w * adv * logp).sum() / mask.sum(), w = 1
        for b, n in enumerate(lengths):
            r = [float(teacher[b, k] - student[b, k]) for k in range(n)]
            for t in range(n):
                w = {k: discount ** (k - t) for k in range(t, n)}
                want = sum(w[k] * r[k] for k in w) / sum(w.values())
                assert float(adv[b, t]) == pytest.approx(want, abs=1e-6)
                later = [(discount ** (k - t), float(kl[b, k])) for k in range(t + 1, n)]
                mean = sum(wk * x for wk, x in later) / sum(wk for wk, _ in later) if later else 0.0
                assert float(-weight[b, t]) == pytest.approx(mean, abs=1e-5)
            assert float(adv[b, n:].abs().sum()) == 0.0 and float(weight[b, n:].abs().sum()) == 0.0
    with pytest.raises(DistillError, match="--kl-length-norm"):
        DistillConfig(teachers=["a=tiny:arithmetic"], kl_length_norm=True).check()


def test_vocabulary_mismatch_names_what_differs(tmp_path):
    from k3.tokenizer.build import write_tokenizer

    student = vocabulary_of("tiny", 1024)
    check_vocabularies(student, {"same": vocabulary_of(str(write_tokenizer(tmp_path / "same", 1024)), 1024)})
    with pytest.raises(DistillError, match=r"teacher big: vocab_size 2048 \(student: 1024\)"):
        check_vocabularies(student, {"ok": student, "big": vocabulary_of("x", 2048)})
    other = tmp_path / "other"
    write_tokenizer(other, 1024)
    lines = (other / "tiktoken.model").read_text().splitlines()
    a, b = lines[300].split(), lines[301].split()
    lines[300], lines[301] = f"{b[0]} {a[1]}", f"{a[0]} {b[1]}"  # two merges swap ranks
    (other / "tiktoken.model").write_text("\n".join(lines) + "\n")
    with pytest.raises(DistillError, match="teacher swapped: the BPE ranks of .*tiktoken.model differ"):
        check_vocabularies(student, {"swapped": vocabulary_of(str(other), 1024)})


def test_teacher_specs_and_domains():
    assert parse_teacher("arith=runs/t/arith:arithmetic") == TeacherSpec(
        "arith", "runs/t/arith", "arithmetic"
    )
    assert parse_teacher("gen=C:/x") == TeacherSpec("gen", "C:/x", None)
    with pytest.raises(DistillError, match="NAME=CKPT"):
        parse_teacher("runs/t")
    specs = [TeacherSpec("a", "x", "arithmetic"), TeacherSpec("g", "y", None)]
    assert assign_domains(specs, ["sort", "arithmetic"]) == {"arithmetic": "a", "sort": "g"}
    with pytest.raises(DistillError, match="task sort has no teacher"):
        assign_domains(specs[:1], ["sort"])
    with pytest.raises(DistillError, match="two teachers"):
        assign_domains([TeacherSpec("a", "x", "sort"), TeacherSpec("b", "y", "sort")], [])


def test_average_weights():
    a, b = _tiny(0), _tiny(1)
    avg = average_weights([a, b])
    k = "lm_head.weight"
    assert torch.allclose(avg[k], (a.state_dict()[k] + b.state_dict()[k]) / 2, atol=1e-7)
    short = K3ForCausalLM.from_config(K3Config.from_pretrained("tiny"), num_layers=1, quantized_experts=False)
    with pytest.raises(DistillError, match="other tensors"):
        average_weights([a, short])
