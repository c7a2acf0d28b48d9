"""Chunked distillation (automodel.loss.chunked_distillation) against the full-logits formulas:
values and gradients in float64 over chunkings, temperatures, both divergences, the logit transforms
of both heads; a hand-worked value; a teacher equal to the student gives 0. Then the model: per
sample, a packed row's cross-entropy and divergence (and their gradients) equal each sample run
alone through transformers' own models (SDPA), float64; a LoRA student's own base as its teacher."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from automodel.loss import TeacherHead, chunked_distillation, sample_token_weights, transform_logits

IGNORE = -100


def full_logits_terms(h, w, b, labels, teacher, *, scale, softcap, divergence, temperature):
    """(ce_T, divergence_T) from the full [T, V] logits of both heads, by the textbook formulas; the
    divergence over the first ``teacher.vocab`` ids of both (all of them when None)."""
    z = transform_logits(F.linear(h, w, b), logit_scale=scale, final_logit_softcap=softcap)
    th = torch.zeros(len(labels), teacher.hidden_ND.shape[1], dtype=h.dtype)
    th[labels != IGNORE] = teacher.hidden_ND
    y = transform_logits(
        F.linear(th, teacher.weight_VD, teacher.bias_V),
        logit_scale=teacher.logit_scale,
        final_logit_softcap=teacher.final_logit_softcap,
    )
    labelled = labels != IGNORE
    ce = F.cross_entropy(z, labels, ignore_index=IGNORE, reduction="none")
    if teacher.vocab is not None:
        z, y = z[:, : teacher.vocab], y[:, : teacher.vocab]
    log_q, log_p = (z / temperature).log_softmax(-1), (y / temperature).log_softmax(-1)
    if divergence == "forward_kl":
        div = (log_p.exp() * (log_p - log_q)).sum(-1)
    else:
        div = (log_q.exp() * (log_q - log_p)).sum(-1)
    return ce.where(labelled, 0.0), div.where(labelled, 0.0)


def case(t, v, d, d_t, masked, seed, bias, teacher_softcap, dtype=torch.float64, teacher_v=None, vocab=None):
    g = torch.Generator().manual_seed(seed)
    teacher_v = v if teacher_v is None else teacher_v
    h = torch.randn(t, d, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(v, d, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(v, generator=g, dtype=dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, (t,), generator=g)
    labels[torch.tensor(masked, dtype=torch.bool)] = IGNORE
    n = int((labels != IGNORE).sum())
    teacher = TeacherHead(
        torch.randn(n, d_t, generator=g, dtype=dtype),
        torch.randn(teacher_v, d_t, generator=g, dtype=dtype),
        torch.randn(teacher_v, generator=g, dtype=dtype) if bias else None,
        logit_scale=0.8,
        final_logit_softcap=teacher_softcap,
        vocab=vocab,
    )
    return h, w, b, labels, teacher


def check(
    t, v, chunk_tokens, masked, *, bias, scale, softcap, teacher_softcap, divergence, temperature, seed=0,
    teacher_v=None, vocab=None,
):  # fmt: skip
    h, w, b, labels, teacher = case(
        t, v, 6, 5, masked, seed, bias, teacher_softcap, teacher_v=teacher_v, vocab=vocab
    )
    params = [x for x in (h, w, b) if x is not None]
    g = torch.Generator().manual_seed(seed + 1)
    weights = torch.rand(2, t, generator=g, dtype=h.dtype)  # arbitrary output gradients, both outputs
    kwargs = dict(scale=scale, softcap=softcap, divergence=divergence, temperature=temperature)
    expected = full_logits_terms(h, w, b, labels, teacher, **kwargs)
    expected_grads = torch.autograd.grad(sum((x * c).sum() for x, c in zip(expected, weights)), params)
    actual = chunked_distillation(
        h, w, labels, teacher, bias_V=b, logit_scale=scale, final_logit_softcap=softcap,
        divergence=divergence, temperature=temperature, chunk_tokens=chunk_tokens,
    )  # fmt: skip
    grads = torch.autograd.grad(sum((x * c).sum() for x, c in zip(actual, weights)), params)
    for got, want in zip(actual, expected, strict=True):
        assert got.dtype == torch.float64 and got.shape == (t,)
        torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected_grads, strict=True):
        assert float((got - want).abs().max()) <= 1e-12 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 64])
@pytest.mark.parametrize(
    ("bias", "scale", "softcap", "teacher_softcap"), [(False, 1.0, None, None), (True, 0.7, 3.0, 2.0)]
)
def test_equals_the_full_logits_formulas_in_float64(
    divergence, temperature, chunk_tokens, bias, scale, softcap, teacher_softcap
):
    check(11, 23, chunk_tokens, [i % 3 == 0 for i in range(11)], bias=bias, scale=scale, softcap=softcap,
          teacher_softcap=teacher_softcap, divergence=divergence, temperature=temperature)  # fmt: skip


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize(("chunk_tokens", "teacher_v"), [(1, 29), (4, 19), (64, 23)])
def test_over_the_tokenizers_ids_equals_the_full_logits_formulas(
    divergence, temperature, chunk_tokens, teacher_v
):
    """Vocabularies padded with rows no token has (the student's 23, the teacher's 29, 19 or 23): the
    divergence compares the first 19 ids of both heads, the cross-entropy all of the student's;
    the backward's vocabulary blocks straddle the 19th id."""
    check(11, 23, chunk_tokens, [i % 3 == 0 for i in range(11)], bias=True, scale=0.7, softcap=3.0,
          teacher_softcap=2.0, divergence=divergence, temperature=temperature, teacher_v=teacher_v, vocab=19)  # fmt: skip


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
def test_a_teacher_that_is_the_student_padded_gives_zero(divergence):
    """The teacher is the student with 8 more (random) rows in its head, rows no token has: over the
    tokenizer's 17 ids the divergence is exactly 0, and it adds no gradient."""
    h, w, b, labels, _ = case(9, 17, 6, 6, [i % 4 == 0 for i in range(9)], 3, True, None, torch.float32)
    g = torch.Generator().manual_seed(4)
    padded_w = torch.cat([w.detach(), torch.randn(8, 6, generator=g)])
    padded_b = torch.cat([b.detach(), torch.randn(8, generator=g)])
    teacher = TeacherHead(h.detach()[labels != IGNORE], padded_w, padded_b, vocab=17)
    _, div = chunked_distillation(h, w, labels, teacher, bias_V=b, divergence=divergence, chunk_tokens=3)
    assert torch.equal(div, torch.zeros_like(div))
    grads = torch.autograd.grad(div.sum(), [h, w, b])
    assert all(float(g.abs().max()) < 1e-6 for g in grads)
    # over all 25 of the teacher's rows (no tokenizer to say which are tokens) it would not be 0
    with pytest.raises(ValueError, match="vocabulary V = 17"):
        chunked_distillation(h, w, labels, TeacherHead(teacher.hidden_ND, padded_w, padded_b), bias_V=b)


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 20), v=st.integers(2, 30), chunk_tokens=st.integers(1, 25), data=st.data())
def test_property_matches_the_full_logits_formulas(t, v, chunk_tokens, data):
    masked = data.draw(st.lists(st.booleans(), min_size=t, max_size=t))
    check(
        t, v, chunk_tokens, masked,
        bias=data.draw(st.booleans()),
        scale=data.draw(st.sampled_from([1.0, 0.5])),
        softcap=data.draw(st.sampled_from([None, 2.0])),
        teacher_softcap=data.draw(st.sampled_from([None, 4.0])),
        divergence=data.draw(st.sampled_from(["forward_kl", "reverse_kl"])),
        temperature=data.draw(st.sampled_from([1.0, 0.5, 3.0])),
        seed=t * 31 + v,
    )  # fmt: skip


def test_hand_worked_values():
    # student logits [0, 0] (q = [1/2, 1/2]), teacher logits [0, ln 3] (p = [1/4, 3/4]), label 1
    hidden = torch.ones(1, 1, dtype=torch.float64)
    student_w = torch.zeros(2, 1, dtype=torch.float64)
    teacher = TeacherHead(hidden, torch.tensor([[0.0], [math.log(3)]], dtype=torch.float64))
    labels = torch.tensor([1])
    forward = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    reverse = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    for divergence, expected in (("forward_kl", forward), ("reverse_kl", reverse)):
        ce, div = chunked_distillation(hidden, student_w, labels, teacher, divergence=divergence)
        assert float(ce[0]) == pytest.approx(math.log(2), rel=1e-14)
        assert float(div[0]) == pytest.approx(expected, rel=1e-14)
    # temperature 2: p = softmax([0, ln 3] / 2) = [1, sqrt 3] / (1 + sqrt 3); q stays uniform
    p1 = math.sqrt(3) / (1 + math.sqrt(3))
    _, div = chunked_distillation(hidden, student_w, labels, teacher, temperature=2.0)
    expected = (1 - p1) * math.log((1 - p1) / 0.5) + p1 * math.log(p1 / 0.5)
    assert float(div[0]) == pytest.approx(expected, rel=1e-14)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
def test_a_teacher_equal_to_the_student_gives_zero_and_no_divergence_gradient(divergence):
    h, w, b, labels, _ = case(9, 17, 6, 6, [i % 4 == 0 for i in range(9)], 3, True, None, torch.float32)
    teacher = TeacherHead(h.detach()[labels != IGNORE], w.detach(), b.detach())
    _, div = chunked_distillation(h, w, labels, teacher, bias_V=b, divergence=divergence, chunk_tokens=3)
    assert torch.equal(div, torch.zeros_like(div))
    grads = torch.autograd.grad(div.sum(), [h, w, b])
    assert all(float(g.abs().max()) < 1e-6 for g in grads)


def test_bf16_under_autocast_is_as_accurate_as_the_full_logits_in_bf16():
    """Under bf16 autocast both heads' matmuls run in bf16 (the compute dtype) and the softmaxes in
    float32: against float64, as accurate as the textbook formulas on bf16 full logits."""
    h, w, _, labels, teacher = case(64, 200, 16, 8, [i % 5 == 0 for i in range(64)], 5, False, None)
    kwargs = dict(scale=1.0, softcap=None, divergence="forward_kl", temperature=1.0)
    exact = torch.stack([x.sum() for x in full_logits_terms(h, w, None, labels, teacher, **kwargs)])
    low = lambda x: x.detach().bfloat16()  # noqa: E731
    naive_teacher = TeacherHead(low(teacher.hidden_ND), low(teacher.weight_VD))
    naive = torch.stack(
        [x.float().sum() for x in full_logits_terms(low(h), low(w), None, labels, naive_teacher, **kwargs)]
    )
    h32, w32 = (x.detach().float().requires_grad_() for x in (h, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        terms = chunked_distillation(h32, w32, labels, naive_teacher, chunk_tokens=16)
    assert all(x.dtype == torch.float32 for x in terms)
    chunked = torch.stack([x.detach().sum() for x in terms]).double()
    assert (
        (chunked - exact).abs() <= 1.25 * (naive.double() - exact.detach()).abs() + 1e-3 * exact.abs()
    ).all()
    grads = torch.autograd.grad(terms[1].sum(), [h32, w32])
    assert all(g.dtype == torch.float32 and g.isfinite().all() for g in grads)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"divergence": "js"}, "divergence must be one of"),
        ({"temperature": 0.0}, "temperature must be a finite positive number"),
        ({"temperature": float("inf")}, "temperature must be a finite positive number"),
        ({"teacher": TeacherHead(torch.zeros(2, 3), torch.zeros(7, 3))}, "N = 3 labelled positions"),
        ({"teacher": TeacherHead(torch.zeros(3, 3), torch.zeros(6, 3))}, "vocabulary V = 7"),
        ({"teacher": TeacherHead(torch.zeros(3, 3), None)}, "teacher.weight_VD is None"),
        ({"teacher": TeacherHead(torch.zeros(3, 3), torch.zeros(7, 3), torch.zeros(6))}, "teacher.bias_V"),
        (
            {"teacher": TeacherHead(torch.zeros(3, 3), torch.zeros(9, 3), vocab=8)},
            "at most both vocabularies",
        ),
        (
            {"teacher": TeacherHead(torch.zeros(3, 3), torch.zeros(5, 3), vocab=6)},
            "at most both vocabularies",
        ),
    ],
)
def test_bad_arguments_are_named(change, message):
    args = {"teacher": TeacherHead(torch.zeros(3, 3), torch.zeros(7, 3))} | change
    with pytest.raises(ValueError, match=message):
        chunked_distillation(torch.zeros(4, 2), torch.zeros(7, 2), torch.tensor([0, 1, 2, IGNORE]), **args)


def test_sample_token_weights_worked_example():
    weights, samples = sample_token_weights(torch.tensor([IGNORE, 7, 7, 7, IGNORE]), torch.tensor([3, 2]))
    assert weights.tolist() == [0.0, 0.5, 0.5, 1.0, 0.0] and samples == 2
    # a sample without labels (a filler) weighs nothing and is not counted
    weights, samples = sample_token_weights(
        torch.tensor([IGNORE, IGNORE, 3, 3, 3, IGNORE]), torch.tensor([2, 4])
    )
    assert weights.tolist() == pytest.approx([0, 0, 1 / 3, 1 / 3, 1 / 3, 0]) and samples == 1


# --- the model: a packed row against each sample alone --------------------------------------------

SAMPLES = [(7, [1, 2]), (4, [0]), (11, [2, 3, 6, 9])]  # (length, unlabelled positions): three lengths


def tiny_model(seed: int, *, lora: bool = False):
    from automodel.models import ModelSpec, build_model, setup_checks
    from automodel.models.lora import LoraConfig

    spec = ModelSpec(
        config=dict(model_type="llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
        attention_backend="portable",
    )  # fmt: skip
    config, _ = setup_checks(spec, cp_size=1, vocab_needed=None, max_sample_tokens=None)
    adapters = LoraConfig(target_modules="all-linear", rank=4, alpha=8) if lora else None
    model = build_model(
        spec, config, device=torch.device("cpu"), shard=lambda m: None, seed=seed, lora=adapters
    )
    return model.double(), config


def packed_row(vocab: int):
    """One packed row of SAMPLES (each padded to a multiple of 2), sharded for one rank."""
    from automodel.attention import ThdAttentionMetadata
    from automodel.distributed import make_cp_batch_for_te

    g = torch.Generator().manual_seed(7)
    alone, ids, labels, positions, lens, padded = [], [], [], [], [], []
    for length, unlabelled in SAMPLES:
        x = torch.randint(0, vocab, (length,), generator=g)
        y = torch.randint(0, vocab, (length,), generator=g)
        y[unlabelled] = IGNORE
        alone.append((x, y))
        pad = length % 2
        ids.append(torch.cat([x, torch.zeros(pad, dtype=x.dtype)]))
        labels.append(torch.cat([y, torch.full((pad,), IGNORE)]))
        positions.append(torch.arange(length + pad))
        lens.append(length)
        padded.append(length + pad)
    batch = make_cp_batch_for_te(None, {
        "input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None],
        "position_ids": torch.cat(positions)[None], "seq_lens": torch.tensor([lens]),
        "seq_lens_padded": torch.tensor([padded]),
    })  # fmt: skip
    batch["attn_meta"] = ThdAttentionMetadata.from_batch(batch)
    return batch, alone


def reference_copy(model, config):
    """The same weights in transformers' own class, float64 (SDPA: eager attention's softmax is float32)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64)
    reference.load_state_dict(model.transformers_model.state_dict())
    return reference


def per_sample(values_T: torch.Tensor, meta) -> torch.Tensor:
    sample_T = torch.repeat_interleave(torch.arange(len(meta.padded_lens)), meta.padded_lens)
    return torch.zeros(len(meta.padded_lens), dtype=values_T.dtype).index_add(0, sample_T, values_T)


@pytest.mark.parametrize(("divergence", "temperature"), [("forward_kl", 1.0), ("reverse_kl", 2.0)])
def test_packed_row_per_sample_equals_each_sample_alone_in_float64(divergence, temperature):
    student, config = tiny_model(seed=1)
    teacher, _ = tiny_model(seed=2)
    batch, alone = packed_row(config.vocab_size)
    args = (batch["input_ids"], batch["position_ids"], batch["labels"], batch["attn_meta"])
    with torch.no_grad():
        head = teacher(*args, output="teacher")
    ce_T, div_T = student(
        *args, output="distill", teacher=head, divergence=divergence, temperature=temperature
    )
    ce_S, div_S = per_sample(ce_T, batch["attn_meta"]), per_sample(div_T, batch["attn_meta"])
    (ce_S.sum() + div_S.sum()).backward()

    alone_student, alone_teacher = reference_copy(student, config), reference_copy(teacher, config)
    for s, (x, y) in enumerate(alone):
        with torch.no_grad():
            teacher_logits = alone_teacher(x[None]).logits[0]
        logits = alone_student(x[None]).logits[0]
        labelled = y != IGNORE
        ce = F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum")
        log_q, log_p = (logits / temperature).log_softmax(-1), (teacher_logits / temperature).log_softmax(-1)
        pointwise = (
            log_p.exp() * (log_p - log_q) if divergence == "forward_kl" else log_q.exp() * (log_q - log_p)
        )
        div = pointwise.sum(-1)[labelled].sum()
        assert float(ce_S[s].detach()) == pytest.approx(float(ce.detach()), rel=1e-12), s
        assert float(div_S[s].detach()) == pytest.approx(float(div.detach()), rel=1e-10), s
        (ce + div).backward()
    expected = dict(alone_student.named_parameters())
    for name, param in student.transformers_model.named_parameters():
        scale = float(expected[name].grad.abs().max())
        assert float((param.grad - expected[name].grad).abs().max()) <= 1e-10 * max(scale, 1e-6), name


def test_a_lora_students_own_base_as_teacher_gives_zero_then_not(tmp_path):
    """kd.teacher=base: the teacher pass is the student with its adapters disabled; lora_B starts at
    0, so the first divergence is exactly 0; after adapters move, it is not."""
    from automodel.loss import TeacherHead

    student, config = tiny_model(seed=1, lora=True)
    batch, _ = packed_row(config.vocab_size)
    args = (batch["input_ids"], batch["position_ids"], batch["labels"], batch["attn_meta"])

    def divergence():
        with torch.no_grad(), student.hf.disable_adapter():
            head = TeacherHead(student(*args, output="hidden"), None)
        return student(*args, output="distill", teacher=head)[1]

    assert torch.equal(divergence(), torch.zeros(len(batch["labels"]), dtype=torch.float64))
    with torch.no_grad():
        for name, param in student.named_parameters():
            if "lora_B" in name:
                param.add_(0.05)
    moved = divergence()
    assert float(moved.detach().sum()) > 1e-6
    moved.sum().backward()
    assert all(
        (p.grad is None) == (not p.requires_grad) for p in student.parameters()
    )  # adapters get gradients, the frozen base none
