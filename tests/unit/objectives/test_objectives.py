"""CLM / MLM / MNTP against direct reference computations on a random tiny Llama and real packed text."""

from __future__ import annotations

import importlib
import math
import os
import pkgutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_llama, unit_text_batch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import WordLevel
from torch.utils.flop_counter import FlopCounterMode
from transformers import PreTrainedTokenizerFast

from pipeline.config import ConfigError, from_tagged
from pipeline.data.format.index import ShardKind
from pipeline.data.format.instructions import DEFAULT_FORMAT
from pipeline.data.format.sample import UNMASKABLE
from pipeline.data.loading.batch import Batch, collate
from pipeline.data.prep.build_sample import PlanSettings, make_sample
from pipeline.data.prep.packing import Packer
from pipeline.experiment import load_experiment
from pipeline.export.record import POOLINGS, last_reading
from pipeline.model.attention import attention_inputs
from pipeline.model.build import build_model, model_spec
from pipeline.model.flops import Work, work_flops
from pipeline.objectives import (
    CLM,
    MLM,
    MNTP,
    OBJECTIVES,
    SSCL,
    CLMConfig,
    Magnet,
    MagnetConfig,
    Masking,
    MaskingConfig,
    MLMConfig,
    MNTPConfig,
    ObjectiveConfig,
    SimCSE,
    SimCSEConfig,
    SSCLConfig,
    Supervised,
    SupervisedConfig,
    make_objective,
)
from pipeline.objectives.base import Objective, resolve_mask_id
from pipeline.objectives.configs import Reading
from pipeline.tokenizer import Tokenizer, load_tokenizer

SEQ_LEN = 32
TOKENIZER_DIR = os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "../../..")), "data", "sample", "tokenizer")
TEXTS = [  # Shakespeare, public domain: short and long documents, so some cross sample boundaries
    "To be, or not to be, that is the question.",
    "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune, or to take arms "
    "against a sea of troubles and by opposing end them.",
    "All the world's a stage.",
    "Now is the winter of our discontent made glorious summer by this sun of York.",
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him.",
    "The lady doth protest too much, methinks.",
    "If music be the food of love, play on; give me excess of it, that, surfeiting, the appetite may sicken, "
    "and so die.",
    "Brevity is the soul of wit.",
]


def make_batch(tokenizer: Tokenizer, seed: int = 0) -> Batch:
    """Real text packed as data prep packs it: three full samples and a padded last one, with real plans."""
    docs = tokenizer.encode_batch(TEXTS)
    packer = Packer(SEQ_LEN, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, "pad")
    packed: list[tuple[np.ndarray, np.ndarray]] = []
    for i in np.random.default_rng(seed).permutation(len(docs)):
        packed += packer.add(docs[i])
    packed += packer.finish()
    plan = PlanSettings(seed=seed, special_ids=np.array(tokenizer.special_ids), span_min=2, span_max=6)
    return collate([make_sample(ids, segs, 0, i, plan) for i, (ids, segs) in enumerate(packed[-4:])])


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    return build_model(model_spec("tiny", tokenizer.info.vocab_size, attn_implementation="sdpa", pad_token_id=tokenizer.pad_id,
                       bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id))


def mlm(tokenizer, **masking) -> MLM:
    return make_objective(MLMConfig(**masking), tokenizer)


def mntp(tokenizer, **masking) -> MNTP:
    return make_objective(MNTPConfig(**masking), tokenizer)


def attention(model, mode, batch):
    return attention_inputs(mode, batch.doc_ids, attn_implementation=model.config._attn_implementation,
                            dtype=model.dtype)


def has_same_doc_predecessor(doc_ids: torch.Tensor) -> torch.Tensor:
    prev = torch.full_like(doc_ids, -2)
    prev[:, 1:] = doc_ids[:, :-1]
    return (doc_ids >= 0) & (prev == doc_ids)


def test_batch_is_packed_and_padded(tokenizer):
    batch = make_batch(tokenizer)
    assert (batch.doc_ids[3] == -1).any() and (batch.doc_ids[:3] >= 0).all()
    assert (batch.doc_ids.amax(-1)[:3] >= 1).any()  # document boundaries inside a sample
    assert (batch.input_ids[:3, 0] != tokenizer.bos_id).any()  # a document continued from the previous sample


def test_clm_equals_transformers_shifted_loss(model, tokenizer):
    batch = make_batch(tokenizer)
    out = CLM(CLMConfig())(model, batch)["clm"]
    labels = torch.where(has_same_doc_predecessor(batch.doc_ids), batch.input_ids, -100)
    with torch.no_grad():
        ref = model(input_ids=batch.input_ids, labels=labels, **attention(model, "causal", batch))
    n = int((labels != -100).sum())
    assert int(out.num_targets) == n
    torch.testing.assert_close(out.loss_sum.detach(), ref.loss * n)
    predicted = ref.logits[:, :-1].argmax(-1)
    assert int(out.num_correct) == int(((predicted == labels[:, 1:]) & (labels[:, 1:] != -100)).sum())


def test_mntp_equals_transformers_shifted_loss(model, tokenizer):
    batch = make_batch(tokenizer, 1)
    objective = mntp(tokenizer, ratio=0.4, mask_token="\u2581the")
    out = objective(model, batch)["mntp"]
    masked_ids, is_target = objective.masking.apply(batch)
    the = tokenizer.hf.get_vocab()["\u2581the"]
    assert (masked_ids[is_target] == the).float().mean() > 0.5  # 80 % of targets show the mask token
    labels = torch.where(is_target & has_same_doc_predecessor(batch.doc_ids), batch.input_ids, -100)
    with torch.no_grad():  # LLM2Vec: LlamaForCausalLM's own shifted loss on the masked input, bidirectional
        ref = model(input_ids=masked_ids, labels=labels, **attention(model, "bidirectional", batch))
    n = int((labels != -100).sum())
    assert int(out.num_targets) == n > 0
    torch.testing.assert_close(out.loss_sum.detach(), ref.loss * n)


def test_mlm_equals_hand_loop(model, tokenizer):
    batch = make_batch(tokenizer, 2)
    objective = mlm(tokenizer, ratio=0.3, policy="mask")
    out = objective(model, batch)["mlm"]
    masked_ids, is_target = objective.masking.apply(batch)
    assert (masked_ids[is_target] == tokenizer.mask_id).all()
    assert torch.equal(masked_ids[~is_target], batch.input_ids[~is_target])
    with torch.no_grad():
        logits = model(input_ids=masked_ids, **attention(model, "bidirectional", batch)).logits
    loss, correct = 0.0, 0
    for b, i in is_target.nonzero().tolist():
        loss += -torch.log_softmax(logits[b, i].double(), -1)[batch.input_ids[b, i]].item()
        correct += int(logits[b, i].argmax() == batch.input_ids[b, i])
    assert int(out.num_targets) == int(is_target.sum()) > 0
    assert out.loss_sum.item() == pytest.approx(loss, rel=1e-5)
    assert int(out.num_correct) == correct


@pytest.mark.parametrize("name", ["clm", "mlm", "mntp"])
def test_target_only_head_equals_full_head(model, tokenizer, name):
    batch = make_batch(tokenizer, 3)
    objective = make_objective(from_tagged(ObjectiveConfig, {"name": name}), tokenizer)
    out = objective(model, batch)[name]
    targets = objective.targets(batch)
    with torch.no_grad():
        logits = model(input_ids=targets.input_ids, **attention(model, objective.attention_mode, batch)).logits
    full = F.cross_entropy(logits.transpose(1, 2), targets.labels, reduction="none")
    torch.testing.assert_close(out.loss_sum.detach(), full[targets.predict_at].sum())
    assert objective.num_targets(batch) == {name: int(out.num_targets)}


def test_targets_on_a_hand_written_batch(tokenizer):
    """Two documents [5 6 7 | 8 9 10]: with everything masked, MLM predicts all six tokens in place; CLM and MNTP
    predict 6, 7, 9, 10 from the previous position and never the first token of a document."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    batch = Batch(input_ids=ids, doc_ids=torch.tensor([[0, 0, 0, 1, 1, 1]], dtype=torch.int32),
                  mask_rank=torch.arange(6, dtype=torch.int32)[None], mask_draw=torch.zeros(1, 6, dtype=torch.int64),
                  span_ids=torch.full((1, 6), -1, dtype=torch.int32), keys=["hand"])
    everything = {"ratio": 1.0, "policy": "mask"}
    mlm_t, mntp_t = mlm(tokenizer, **everything).targets(batch), mntp(tokenizer, **everything).targets(batch)
    clm_t = CLM(CLMConfig()).targets(batch)
    assert mlm_t.predict_at.tolist() == [[True] * 6] and mlm_t.labels.tolist() == ids.tolist()
    assert (mlm_t.input_ids == tokenizer.mask_id).all() and (mntp_t.input_ids == tokenizer.mask_id).all()
    assert torch.equal(clm_t.input_ids, ids)
    for t in (mntp_t, clm_t):
        assert t.predict_at.tolist() == [[True, True, False, True, True, False]]
        assert t.labels[t.predict_at].tolist() == [6, 7, 9, 10]


def test_ratio_follows_the_plan(tokenizer):
    batch = make_batch(tokenizer, 4)
    maskable = (batch.mask_rank != int(UNMASKABLE)).sum(-1)
    for ratio in (0.2, 0.5):
        predict_at = mlm(tokenizer, ratio=ratio).targets(batch).predict_at
        assert predict_at.sum(-1).tolist() == torch.floor(ratio * maskable.double() + 0.5).long().tolist()


PHASE = 11  # steps of the phase below: step i lies at fraction i / 10 of it
SCHEDULES = {  # ratio_schedule -> the ratio of each step of the phase from ratio 0.4, by hand
    "linear": ({"shape": "linear", "final": 0.1}, [0.4 - 0.03 * i for i in range(PHASE)]),
    "cosine": ({"shape": "cosine", "final": 0.1, "start": 0.5},
               [0.4 - 0.3 * (1 - math.cos(math.pi * max(i - 5, 0) / 5)) / 2 for i in range(PHASE)]),
    "step": ({"shape": "step", "steps": [[0.3, 0.25], [0.8, 0.1]]}, [0.4] * 3 + [0.25] * 5 + [0.1] * 3),
}


@pytest.mark.parametrize("shape", SCHEDULES)
def test_masks_drawn_at_each_step_of_the_phase_follow_the_ratio_schedule(tokenizer, shape):
    """Each masking objective (MAGNET's on context only) masks round(ratio x maskable) tokens of each row at the
    schedule's ratio of the step, counted in the input the model reads, whatever the order the steps come in."""
    schedule, expected = SCHEDULES[shape]
    batch = make_batch(tokenizer, 6)
    maskable = batch.mask_rank != int(UNMASKABLE)
    for name in ("mlm", "mntp", "magnet"):
        config = from_tagged(ObjectiveConfig, {"name": name, "ratio": 0.4, "policy": "mask",
                                               "ratio_schedule": schedule})
        objective = make_objective(config, tokenizer)
        for step in (7, 0, 10, 3, 5, 9, 3):
            objective.at_phase_step(step, PHASE)
            if name == "magnet":
                context = maskable & (batch.span_ids < 0)
                masked = (objective.view(batch).input_ids == tokenizer.mask_id) & (batch.span_ids < 0)
            else:
                context, masked = maskable, objective.targets(batch).input_ids == tokenizer.mask_id
            n = context.sum(-1).double()
            assert n[:3].min() >= 10 and objective.masking.ratio == pytest.approx(expected[step], abs=1e-12)
            assert ((masked.sum(-1) - expected[step] * n).abs() <= 0.5 + 1e-9).all(), (name, step)


def test_ratio_schedule_errors_name_the_key_and_the_fix():
    key = r"phases\[1\]\.objectives\[0\]\.ratio_schedule"
    cases = {
        "{shape: linear}": rf"{key}\.final: missing; shape linear goes from the objective's ratio to final, e\.g\. "
                           rf"{key}\.final=0\.15$",
        "{shape: constant, final: 0.1}": rf"{key}\.final: shape constant keeps the objective's ratio; drop final",
        "{shape: step, steps: [[0.5, 0.2]], start: 0.5}": rf"{key}\.start: shape step takes its ratios from steps",
        "{shape: cosine, final: 0.1, steps: [[0.5, 0.2]]}": rf"{key}\.steps: shape cosine goes from ratio to final",
        "{shape: step}": rf"{key}\.steps: missing; shape step needs \[fraction, ratio\] pairs",
        "{shape: linear, final: 0.1, start: 0.6, end: 0.5}": rf"{key}: start 0\.6 must come before end 0\.5",
        "{shape: step, steps: [[0.5, 0.2], [0.5, 0.1]]}": rf"{key}\.steps\.1: \[0\.5, 0\.1\] is not allowed; .*each "
                                                          "fraction above the one before",
        "{shape: step, steps: [[0.5, 0]]}": rf"{key}\.steps\.0: \[0\.5, 0\] is not allowed",
        "{shape: linear, final: 1.5}": rf"{key}\.final: 1\.5 is out of range; it must be in \(0, 1\]",
        "{shape: exp}": r"phases\.1\.objectives\.0\.ratio_schedule\.shape: 'exp' is not allowed; choose one of "
                        r"\['constant', 'linear', 'cosine', 'step'\]",
    }
    for schedule, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_experiment(None, [f"phases=[{{share: 0.5, objectives: [{{name: clm}}]}}, {{share: 0.5, objectives: "
                                   f"[{{name: magnet, ratio_schedule: {schedule}}}]}}]"])


def test_padding_rows_give_no_targets_and_finite_gradients(model, tokenizer):
    batch = make_batch(tokenizer, 5)
    padding = Batch(input_ids=torch.full_like(batch.input_ids, tokenizer.pad_id),
                    doc_ids=torch.full_like(batch.doc_ids, -1),
                    mask_rank=torch.full_like(batch.mask_rank, int(UNMASKABLE)), mask_draw=batch.mask_draw,
                    span_ids=batch.span_ids, keys=batch.keys)
    for objective in (CLM(CLMConfig()), mlm(tokenizer), mntp(tokenizer)):
        model.zero_grad()
        out = objective(model, padding)[objective.name]
        assert int(out.num_targets) == 0 and out.loss_sum.item() == 0.0
        out.loss_sum.backward()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    model.zero_grad()
    mlm(tokenizer)(model, batch)["mlm"].loss_sum.backward()
    assert model.lm_head.weight.grad.abs().sum() > 0 and model.model.embed_tokens.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_masking_resolution(tokenizer, tmp_path):
    assert resolve_mask_id(tokenizer, None) == tokenizer.mask_id
    assert resolve_mask_id(tokenizer, "\u2581the") == tokenizer.hf.convert_tokens_to_ids("\u2581the")
    with pytest.raises(ValueError, match="'_' is not a single token of tokenizer .*sample/tokenizer"):
        resolve_mask_id(tokenizer, "_")  # LLM2Vec's Llama choice does not exist in this vocabulary
    words = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "_", "a", "b"])}
    PreTrainedTokenizerFast(tokenizer_object=BackendTokenizer(WordLevel(words, unk_token="<unk>")), unk_token="<unk>",
                            bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path)
    no_mask = load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="has no mask token; set masking.mask_token to an ordinary token such as '_'"):
        resolve_mask_id(no_mask, None)
    resolved = Masking.resolve(MaskingConfig(mask_token="_"), no_mask)
    assert resolved.mask_id == 3 and resolved.random_pool.tolist() == [3, 4, 5]  # never a special token


def test_bad_configuration(tokenizer):
    with pytest.raises(ConfigError, match=r"objectives\.0\.name: 'nsp' is not allowed; choose one of \['clm', 'mlm', 'mntp'"):
        from_tagged(ObjectiveConfig, {"name": "nsp"}, "objectives.0")
    with pytest.raises(ConfigError, match=r"objectives\.0\.name: missing in \{'ratio': 0.4\}; choose one of \['clm'"):
        from_tagged(ObjectiveConfig, {"ratio": 0.4}, "objectives.0")
    with pytest.raises(TypeError, match="'mlm' needs the data's pipeline.tokenizer.Tokenizer.*got NoneType"):
        make_objective(MLMConfig())
    with pytest.raises(TypeError, match=f"got {type(tokenizer.hf).__name__}"):
        make_objective(MLMConfig(), tokenizer.hf)
    with pytest.raises(ValueError, match="masking.policy: '90-10' is not one of 80-10-10, mask"):
        MaskingConfig(policy="90-10")
    with pytest.raises(ValueError, match=r"masking.ratio: 0.0 is outside \(0, 1\]"):
        MaskingConfig(ratio=0.0)
    objective = make_objective(MNTPConfig(ratio=0.2, policy="mask"), tokenizer, document_masking=False)
    assert objective.masking.mask_id == tokenizer.mask_id and objective.document_masking is False


@pytest.mark.parametrize("name", ["clm", "simcse", "sscl"])
@pytest.mark.parametrize("key", ["ratio", "policy", "mask_token"])
def test_masking_fields_on_an_objective_that_does_not_mask_are_an_error(name, key):
    with pytest.raises(ConfigError, match=rf"phases\.0\.objectives\.0\.{key}: unknown key; (did you mean \S+\? )?allowed keys: \['name', 'weight'"):
        from_tagged(ObjectiveConfig, {"name": name, key: "mask" if key == "policy" else 0.4},
                    "phases.0.objectives.0")


def test_configs_are_picked_by_name_and_build_their_objective(tokenizer):
    expected = {"clm": (CLMConfig, CLM), "mlm": (MLMConfig, MLM), "mntp": (MNTPConfig, MNTP),
                "magnet": (MagnetConfig, Magnet), "sscl": (SSCLConfig, SSCL), "simcse": (SimCSEConfig, SimCSE),
                "supervised": (SupervisedConfig, Supervised)}
    assert {n: OBJECTIVES[n] for n in expected} == {n: cls for n, (_, cls) in expected.items()}
    for name, (config_type, cls) in expected.items():
        config = from_tagged(ObjectiveConfig, {"name": name, "weight": 2.0})
        assert type(config) is config_type and config.name == cls.name == name and config.weight == 2.0
        objective = make_objective(config, tokenizer)
        assert type(objective) is cls and objective.config is config
    magnet = from_tagged(ObjectiveConfig, {"name": "magnet", "ratio": 0.2, "mask_token": "<mask>", "msg_weight": 0.5})
    assert (magnet.ratio, magnet.mask_token, magnet.msg_weight, magnet.mntp_weight) == (0.2, "<mask>", 0.5, 1.0)


def test_every_objective_is_registered_by_its_config():
    """An objective is reached by its config's name alone (``OBJECTIVES`` finds each config's class in the module
    of its name): an objective class whose config is left out of ``ObjectiveConfig``, or kept in another module
    than its name's, fails here."""
    defined = {}
    for module in pkgutil.iter_modules([os.path.dirname(importlib.import_module("pipeline.objectives").__file__)]):
        module = importlib.import_module(f"pipeline.objectives.{module.name}")
        defined |= {c: module.__name__ for c in vars(module).values() if isinstance(c, type)
                    and issubclass(c, Objective) and c.__module__ == module.__name__ and "name" in vars(c)}
    unregistered = sorted(c.name for c in defined if c not in OBJECTIVES.values())
    assert not unregistered, f"{unregistered}: add each one's config to ObjectiveConfig (pipeline/objectives/configs.py)"
    assert defined == {cls: f"pipeline.objectives.{name}" for name, cls in OBJECTIVES.items()}
    for name, cls in OBJECTIVES.items():
        assert type(from_tagged(ObjectiveConfig, {"name": name})).__name__ == f"{cls.__name__}Config"


def test_each_objective_declares_what_it_is(tokenizer):
    facts = {name: (cls.masks, cls.predicts_next, cls.causal, bool(cls.needs_tokenizer), cls.shard_kind)
             for name, cls in OBJECTIVES.items()}
    packed, units, pairs = ShardKind.PACKED, ShardKind.UNITS, ShardKind.PAIRS
    assert facts == {"clm": (False, True, True, False, packed), "mlm": (True, False, False, True, packed),
                     "mntp": (True, True, False, True, packed), "magnet": (True, True, False, True, packed),
                     "sscl": (False, False, False, True, units), "simcse": (False, False, False, True, units),
                     "supervised": (False, False, False, False, pairs), "distill": (False, False, False, False, pairs)}
    # a ShardKind equals its string, so a bare "packed" would pass the comparison above: the type is held too
    assert {name: type(cls.shard_kind) for name, cls in OBJECTIVES.items()} == dict.fromkeys(OBJECTIVES, ShardKind)
    required = {"distill": {"teacher": "runs/shards/pairs/teacher"}}  # read at attach, not at build
    built = {name: make_objective(from_tagged(ObjectiveConfig, {"name": name, **required.get(name, {})}), tokenizer)
             for name in OBJECTIVES}
    assert {n: o.attention_mode for n, o in built.items()} == {
        "clm": "causal", "mlm": "bidirectional", "mntp": "bidirectional", "magnet": "magnet",
        "sscl": "bidirectional", "simcse": "bidirectional", "supervised": "bidirectional", "distill": "bidirectional"}
    assert {n: o.loss_weights for n, o in built.items()} == {
        "clm": {"clm": 1.0}, "mlm": {"mlm": 1.0}, "mntp": {"mntp": 1.0}, "magnet": {"mntp": 1.0, "msg": 1.0},
        "sscl": {"sscl": 1.0}, "simcse": {"simcse": 1.0}, "supervised": {"supervised": 1.0},
        "distill": {"distill_embedding": 1.0, "distill_kl": 1.0}}
    magnet = [make_objective(MagnetConfig(**w), tokenizer) for w in ({"msg_weight": 0.0}, {"own_span_only": True},
                                                                    {"mntp_weight": 0.0, "msg_weight": 2.0})]
    assert [(o.attention_mode, o.loss_weights) for o in magnet] == [
        ("bidirectional", {"mntp": 1.0}), ("magnet_own_span", {"mntp": 1.0, "msg": 1.0}), ("magnet", {"msg": 2.0})]


def test_each_objective_declares_how_its_model_reads_text():
    """Every registered objective's config declares its pooling (None: it trains no embedding) and the instruction
    it trains with, which the export's record and card read: one added without POOLING fails here."""
    required = {"distill": {"teacher": "runs/shards/pairs/teacher"}}
    configs = {name: from_tagged(ObjectiveConfig, {"name": name, **required.get(name, {})}) for name in OBJECTIVES}
    undeclared = [name for name, c in configs.items() if not hasattr(type(c), "POOLING")]
    assert not undeclared, f"{undeclared}: declare POOLING on each config (pipeline/objectives/configs.py)"
    assert {name: c.reading() for name, c in configs.items()} == {
        "clm": None, "mlm": None, "mntp": None, "magnet": None, "simcse": Reading("mean"),
        "sscl": Reading("last", SSCLConfig().instruction), "supervised": Reading("mean", None, DEFAULT_FORMAT),
        "distill": Reading("mean")}
    assert all(c.POOLING in (None, *POOLINGS) for c in configs.values())
    assert SupervisedConfig(instruction="Find it").reading() == Reading("mean", "Find it", DEFAULT_FORMAT)
    # one phase of several: the last token beats the mean, a formatted instruction a verbatim one
    assert last_reading([CLMConfig(), SimCSEConfig(), SSCLConfig(instruction="Q:")]) == Reading("last", "Q:")
    assert last_reading([SSCLConfig(), SupervisedConfig()]) == Reading("last", None, DEFAULT_FORMAT)
    assert last_reading([MNTPConfig()]) == Reading("mean")


@pytest.mark.parametrize("config", [MLMConfig(), MNTPConfig(), SimCSEConfig(), SSCLConfig(augment="swap")],
                         ids=lambda c: c.name)
def test_model_flops_of_a_micro_batch_are_what_its_forward_and_backward_compute(tokenizer, config):
    """The trainer's MFU counts an objective's body work and the LM head on its token targets only (none for the
    contrastive objectives, whose units run twice): torch's FLOP count of the forward and backward. Rows of one
    unpadded unit each, so the model computes nothing the count leaves out (padding, other documents)."""
    ids = tokenizer.encode_batch([TEXTS[0]])[0]
    batch = unit_text_batch(tokenizer, [TEXTS[0]] * 4, seq_len=len(ids) + 2)
    assert (batch.doc_ids == 0).all()
    objective = make_objective(config, tokenizer)
    lm = tiny_llama(tokenizer, attention_dropout=0.1)  # SimCSE's and SSCL's dropout views
    objective.attach(lm)
    tokens, pairs = objective.body_work(batch).tolist()
    head_targets = int(sum(objective.num_targets(batch).values())) if objective.predicts_tokens else 0
    with FlopCounterMode(display=False) as counter:
        sum(out.loss_sum for out in objective(lm, batch).values()).backward()
    expected = work_flops(lm.config, Work(tokens=tokens, head_targets=head_targets, attended_pairs=pairs))
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.01)  # the norms count as matmul parameters
