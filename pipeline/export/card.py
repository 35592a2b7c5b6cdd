"""The model card (``README.md``) of every HF export, as sentence-transformers' own ``save`` writes one: the YAML
front matter the Hub reads (``base_model``, ``library_name``, ``pipeline_tag``, ``tags``) and a body that says how
the run trained the model and how to load and embed with it exactly as ``pipeline.eval.encode`` does."""

from __future__ import annotations

import os

import yaml

from pipeline.experiment import ExperimentConfig
from pipeline.export.record import EncoderRecord
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


def metadata(record: EncoderRecord, exp: ExperimentConfig, sentence_transformers: bool) -> dict:
    """The card's YAML front matter."""
    names = sorted({name for phase in record.objectives for name in phase.split("+")})
    tags = ["decoder-encoders", *sorted({METHODS[n] for n in names if n in METHODS}), *names]
    if sentence_transformers:
        tags.append("sentence-transformers")
    if exp.model.lora.r:
        tags.append("lora")
    meta = {"library_name": "sentence-transformers" if sentence_transformers else "transformers",
            "pipeline_tag": "feature-extraction" if is_encoder(record, sentence_transformers) else "text-generation",
            "tags": tags}
    if exp.model.init not in PRESETS:
        meta = {"base_model": exp.model.init, **meta}
    return meta


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


def _usage(path: str, record: EncoderRecord, sentence_transformers: bool, special: tuple[list[int], list[int]]
           ) -> str:
    if sentence_transformers:
        return ("```python\nfrom sentence_transformers import SentenceTransformer\n"
                f'embeddings = SentenceTransformer("{path}").encode(["A sentence to embed."])\n```\n')
    if not is_encoder(record, False):
        return ("```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
                f'model, tok = AutoModelForCausalLM.from_pretrained("{path}"), AutoTokenizer.from_pretrained("{path}")\n'
                'print(tok.decode(model.generate(**tok("Once upon a time", return_tensors="pt"))[0]))\n```\n')
    if record.pooling not in POOL:
        return f"Pool the last hidden states with {record.pooling!r} pooling (`pipeline.eval.encode`).\n"
    note = (f"\nWith its instruction {record.instruction!r} (format {record.instruction_format!r}), "
            "`pipeline.eval.encode` also leaves the instruction's tokens out of the mean.\n"
            if record.instruction and record.pooling == "mean" else "")
    return f"```python\n{embed_snippet(path, record, special)}```\n{note}"


def body(out: str, record: EncoderRecord, exp: ExperimentConfig, step: int, tokens: int | None,
         sentence_transformers: bool, special: tuple[list[int], list[int]]) -> str:
    """The card's text: the run (start, objectives per phase, data, steps, tokens) and how to use the export."""
    phases = "\n".join(f"- {p.name or f'phase {i}'} ({p.share:g} of the steps): "
                       + ", ".join(o.name for o in p.objectives) + _context(exp, i) for i, p in enumerate(exp.phases))
    lora = (f" as LoRA adapters (r {exp.model.lora.r}, alpha {exp.model.lora.alpha:g}) merged into the weights; "
            "the adapter alone is in `adapter/`" if exp.model.lora.r else "")
    reading = (f"{record.attention} attention, {record.pooling} pooling, layout `{record.layout}`"
               + (f", instruction {record.instruction!r}" if record.instruction else ""))
    seen = f", {tokens:,} tokens" if tokens else ""
    return (f"# {exp.name or 'decoder-encoders export'}\n\n"
            f"Trained with decoder-encoders from `{exp.model.init}`{lora}.\n\n"
            f"Objectives so far (the start checkpoint's first): {', then '.join(record.objectives) or 'none'}. "
            f"This run's phases:\n\n{phases}\n\n"
            f"Data: the shards in `{exp.data.shards}` (sequence length {exp.data.seq_len}); {step} steps{seen}.\n\n"
            f"Read as trained ({reading}; `config.json` → `decoder_encoders`, `is_causal`).\n\n"
            f"## Usage\n\n{_usage(out, record, sentence_transformers, special)}")


def _context(exp: ExperimentConfig, i: int) -> str:
    """A context-extension phase's shards, sequence length and RoPE theta ("" for a phase at the run's)."""
    data, theta = exp.phase_data(i), exp.phases[i].rope_theta
    if data.loader == "packed" and theta is None:
        return ""
    return f"; the shards in `{data.shards}` (sequence length {data.seq_len})" + (
        f", RoPE θ {theta:g}" if theta is not None else "")


def write_card(out: str, record: EncoderRecord, exp: ExperimentConfig, step: int, tokens: int | None,
               sentence_transformers: bool, tokenizer: Tokenizer) -> None:
    """Write ``out/README.md``; its snippets load ``out``."""
    from pipeline.eval.encode import special_tokens  # pipeline.eval imports the exports

    special = special_tokens(tokenizer, "special") if record.layout == "special" else ([], [])
    front = yaml.safe_dump(metadata(record, exp, sentence_transformers), sort_keys=False)
    text = body(out, record, exp, step, tokens, sentence_transformers, special)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(f"---\n{front}---\n\n{text}")
