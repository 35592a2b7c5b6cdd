"""The model card (``README.md``) of every HF export, written with huggingface_hub's own ``ModelCard`` as
sentence-transformers' ``save`` writes one: the YAML front matter the Hub reads (``base_model`` and ``datasets`` as
Hub ids only, ``license``, ``library_name``, ``pipeline_tag``, ``tags``, ``model-index`` from the step's evaluations)
and a body that says in words how the run trained the model, and how to load and embed with it exactly as
``pipeline.eval.encode`` does, from the directory the card sits in. No local absolute path: the card travels."""

from __future__ import annotations

import os

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from pipeline.data.format.instructions import special_tokens
from pipeline.experiment import ExperimentConfig
from pipeline.export.hub import base_model, license_fields, local_name, start_card
from pipeline.export.record import EncoderRecord
from pipeline.export.summary import optimiser, phases
from pipeline.model.load_hf import causal_lm_kwargs
from pipeline.model.presets import PRESETS
from pipeline.tokenizer import Tokenizer

# a method's tag beside its objectives' own names (LLM2Vec: MNTP then SimCSE; MAGNET: its objective and SSCL)
METHODS = {"mntp": "llm2vec", "simcse": "llm2vec", "magnet": "magnet", "sscl": "magnet"}
# how ``encode`` lays a text out, as the snippet writes it (``special``: the tokenizer's own, given as ids)
HEAD_TAIL = {"bos_eos": ("[tok.bos_token_id]", "[tok.eos_token_id]"), "text": ("[]", "[]")}
POOL = {
    "mean": ("text = torch.zeros(batch.input_ids.shape)  # pool the text tokens alone, as encode() does\n"
             "for i, ids in enumerate(text_ids):\n"
             "    text[i, len(head):len(head) + len(ids)] = 1\n"
             "embeddings = (states * text.unsqueeze(-1)).sum(1) / text.sum(1, keepdim=True)\n"),
    "last": "embeddings = states[torch.arange(len(texts)), batch.attention_mask.sum(1) - 1]  # the last token\n",
}


def is_encoder(record: EncoderRecord, sentence_transformers: bool) -> bool:
    """Whether an export is an encoder (a bidirectional run's, or one sentence-transformers loads)."""
    return record.attention == "bidirectional" or sentence_transformers


def tags(record: EncoderRecord, exp: ExperimentConfig, sentence_transformers: bool) -> list[str]:
    """The project, the method (LLM2Vec, MAGNET), each objective, and the library and LoRA when they apply."""
    names = sorted({name for phase in record.objectives for name in phase.split("+")})
    out = ["decoder-encoders", *sorted({METHODS[n] for n in names if n in METHODS}), *names]
    return out + ["sentence-transformers"] * sentence_transformers + ["lora"] * bool(exp.model.lora.r)


def model_name(exp: ExperimentConfig) -> str:
    """The model's name on the Hub (the repo's, when ``export.repo_id`` names it) and in the card's title."""
    return exp.export.repo_id.split("/")[-1] if exp.export.repo_id else exp.name or "decoder-encoders export"


def metadata(record: EncoderRecord, exp: ExperimentConfig, sentence_transformers: bool,
             results: list[EvalResult] = ()) -> ModelCardData:
    """The card's YAML front matter, as huggingface_hub writes it: Hub ids only (``pipeline.export.hub``), the
    evaluation ``results`` as its ``model-index``."""
    start = start_card(exp)
    return ModelCardData(base_model=base_model(exp, start), datasets=list(exp.export.datasets) or None,
                         library_name="sentence-transformers" if sentence_transformers else "transformers",
                         pipeline_tag="feature-extraction" if is_encoder(record, sentence_transformers)
                         else "text-generation", tags=tags(record, exp, sentence_transformers),
                         model_name=model_name(exp) if results else None, eval_results=list(results) or None,
                         **license_fields(exp, start))


def embed_snippet(path: str, record: EncoderRecord, special: tuple[list[int], list[int]]) -> str:
    """Python that embeds texts with transformers alone as ``encode`` does under ``record`` (its layout, pooling
    and instruction); ``special``: the tokenizer's own (head, tail) ids, for layout ``special``."""
    head, tail = HEAD_TAIL.get(record.layout, tuple(map(str, special)))
    texts = '["A sentence to embed.", "Another, longer sentence to embed."]'
    if record.instruction and record.pooling == "last":  # tokenized with the text as one string, as encode() does
        texts = f"[{record.instruction!r} + t for t in {texts}]"
    return ("import torch\n"
            "from transformers import AutoModel, AutoTokenizer\n\n"
            f'path = "{path}"\n'
            "model, tok = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)\n"
            f"texts = {texts}\n"
            f"head, tail = {head}, {tail}  # around each text: layout {record.layout!r}, as encode() reads it\n"
            "text_ids = tok(texts, add_special_tokens=False).input_ids\n"
            "batch = tok.pad({\"input_ids\": [head + ids + tail for ids in text_ids]}, padding_side=\"right\",\n"
            "                return_tensors=\"pt\")\n"
            "with torch.no_grad():\n"
            "    states = model(**batch).last_hidden_state  # as trained: config.json's is_causal says how\n"
            + POOL[record.pooling])


def adapter_snippet(path: str, encoder: bool, base_variant: bool) -> str:
    """Python that puts the export's LoRA adapter (``adapter/``) on its base, read with the export's config (so as
    the export reads text: ``is_causal``, RoPE), giving the merged export's states. The base loads as the causal LM
    it is (``variant="lm"`` for an encoder export's: ``pipeline.export.weights``), so no LOAD REPORT; an encoder's
    adapter goes on the base model under the LM head."""
    variant = ', variant="lm"' if base_variant else ""
    body, same = (".base_model  # the base model under the LM head", "AutoModel") if encoder else (
        "", "AutoModelForCausalLM")
    return ("from peft import PeftConfig, PeftModel\n"
            "from transformers import AutoConfig, AutoModelForCausalLM\n\n"
            f'path = "{path}"\n'
            'base = PeftConfig.from_pretrained(path, subfolder="adapter").base_model_name_or_path\n'
            "config = AutoConfig.from_pretrained(path)  # the export's: the base reads text as the run trained it\n"
            f"model = AutoModelForCausalLM.from_pretrained(base, config=config{variant}){body}\n"
            'model = PeftModel.from_pretrained(model, path, subfolder="adapter").eval()\n'
            f"# the states of {same}.from_pretrained(path)\n")


def _adapter_usage(path: str, encoder: bool, exp: ExperimentConfig) -> str:
    """The adapter's section: how it loads, and how to point it at its base elsewhere."""
    return ("### The LoRA adapter alone\n\n"
            "`adapter/` holds the adapter in PEFT's format. `adapter/adapter_config.json` names its base (the start "
            "checkpoint) as `base_model_name_or_path`: its Hub id where it came from the Hub, else its absolute path "
            "on the machine that trained it; elsewhere, set that field (or `base` below) to the base's directory or "
            "Hub id.\n\n"
            f"```python\n{adapter_snippet(path, encoder, bool(causal_lm_kwargs(exp.model.init)))}```\n")


def usage_snippet(path: str, record: EncoderRecord, sentence_transformers: bool, special: tuple[list[int], list[int]]
           ) -> str:
    if sentence_transformers:
        return ("```python\nfrom sentence_transformers import SentenceTransformer\n"
                f'embeddings = SentenceTransformer("{path}").encode(["A sentence to embed."])\n```\n')
    if not is_encoder(record, False):
        return ("```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
                f'model, tok = AutoModelForCausalLM.from_pretrained("{path}"), AutoTokenizer.from_pretrained("{path}")\n'
                'print(tok.decode(model.generate(**tok("Once upon a time", return_tensors="pt"), max_new_tokens=20)[0]))\n'
                '```\n')
    if record.pooling not in POOL:
        return f"Pool the last hidden states with {record.pooling!r} pooling (`pipeline.eval.encode`).\n"
    note = (f"\nWith its instruction {record.instruction!r} (format {record.instruction_format!r}), "
            "`pipeline.eval.encode` also leaves the instruction's tokens out of the mean.\n"
            if record.instruction and record.pooling == "mean" else "")
    return f"```python\n{embed_snippet(path, record, special)}```\n{note}"


def _start(exp: ExperimentConfig, base: str | list[str] | None) -> str:
    """Where the run started, without a local path."""
    if exp.model.init in PRESETS:
        return f"from scratch (the randomly initialised `{exp.model.init}` preset)"
    hub = f" ([{base}](https://huggingface.co/{base}))" if isinstance(base, str) else ""
    return f"from the checkpoint `{local_name(exp.model.init)}`{hub}"


def _data(exp: ExperimentConfig) -> str:
    """The training data: Hub datasets when ``export.datasets`` names them, and the local files by name."""
    hub = (f"the Hub datasets {', '.join(f'[{d}](https://huggingface.co/datasets/{d})' for d in exp.export.datasets)}"
           if exp.export.datasets else "local files, not on the Hub (`export.datasets` names Hub datasets)")
    inputs = sorted({local_name(path) for data in exp.phases_data for path in data.build_inputs})
    built = f"; the shards were built from {', '.join(f'`{i}`' for i in inputs)}" if inputs else ""
    return f"Data: {hub}{built}."


def _usage_note(exp: ExperimentConfig) -> str:
    if exp.export.repo_id:
        return (f"The snippet loads `{exp.export.repo_id}` from the Hub (`export.repo_id`); a local copy loads "
                f"with its directory in place of the id.\n\n")
    return ("Run it from the directory this card is in (the export, or a clone or download of its Hub repository); "
            "from elsewhere, put that directory's path in place of `\".\"`.\n\n")


def body(record: EncoderRecord, exp: ExperimentConfig, step: int, tokens: int | None, sentence_transformers: bool,
         special: tuple[list[int], list[int]], base: str | list[str] | None) -> str:
    """The card's text: the run (start, each phase's objectives in words, data, steps, tokens), how the model
    reads text and how to use it (its evaluations are the metadata's ``model-index``, which the Hub shows)."""
    lora = (f", as LoRA adapters (r {exp.model.lora.r}, alpha {exp.model.lora.alpha:g}) merged into the weights; "
            "the adapter alone is in `adapter/`" if exp.model.lora.r else "")
    reading = (f"{record.attention} attention, {record.pooling} pooling, layout `{record.layout}`"
               + (f", instruction {record.instruction!r}" if record.instruction else ""))
    seen = f" ({tokens:,} tokens)" if tokens else ""
    where = exp.export.repo_id or "."
    return (f"# {model_name(exp)}\n\n"
            f"Trained with decoder-encoders {_start(exp, base)}{lora}.\n\n"
            f"## Training\n\n"
            f"Objectives so far (the start checkpoint's first): {', then '.join(record.objectives) or 'none'}. "
            f"This export is step {step} of {exp.train.steps}{seen}, in {len(exp.phases)} phase(s):\n\n"
            f"{phases(exp)}\n\n{optimiser(exp)}\n\n{_data(exp)}\n\n"
            f"Read as trained ({reading}; `config.json` → `decoder_encoders`, `is_causal`).\n\n"
            f"## Usage\n\n{_usage_note(exp)}{usage_snippet(where, record, sentence_transformers, special)}"
            + (f"\n{_adapter_usage(where, is_encoder(record, sentence_transformers), exp)}" if exp.model.lora.r
               else ""))


def write_card(out: str, record: EncoderRecord, exp: ExperimentConfig, step: int, tokens: int | None,
               sentence_transformers: bool, tokenizer: Tokenizer, results: list[EvalResult] = ()) -> None:
    """Write ``out/README.md`` through huggingface_hub's ``ModelCard``; its snippets load the directory the card
    sits in (or ``export.repo_id``)."""
    special = special_tokens(tokenizer, "special") if record.layout == "special" else ([], [])
    data = metadata(record, exp, sentence_transformers, results)
    text = body(record, exp, step, tokens, sentence_transformers, special, data.base_model)
    ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text}").save(os.path.join(out, "README.md"))
