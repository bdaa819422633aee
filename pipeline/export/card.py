"""The model card (`README.md`) written beside an export: Hugging Face's YAML front matter (so a hub
upload of the export folder is described and linked to its base model) and how to run the file."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import yaml
from gguf.metadata import Metadata

from pipeline.export.naming import DonorIdentity, ShipInfo

# metric key -> (hub metric type, human name); only those present are written
CARD_METRICS = {
    "val_loss": ("loss", "validation loss (nats/token) of the exported weights"),
    "val_ppl": ("perplexity", "validation perplexity"),
    "initial_val_loss": ("loss", "validation loss before training"),
}


@dataclass(frozen=True)
class CardFacts:
    """What the card says beyond the names: the file, its type, the run's numbers and files."""

    file: str  # the conventionally named GGUF
    dtype: str
    metrics: dict[str, float] = field(default_factory=dict)
    steps: int | None = None
    kept_step: int | None = None
    has_adapters: bool = False
    mlflow_run_id: str = ""
    base_file: str = "base.gguf"  # the donor's file name: an adapter's base, a student's draft target


def front_matter(meta: Metadata, donor: DonorIdentity, ship: ShipInfo, facts: CardFacts) -> dict:
    """The hub's model card keys: base_model (+ relation), library_name, license, datasets, tags, metrics."""
    results = [
        {"type": CARD_METRICS[k][0], "name": CARD_METRICS[k][1], "value": round(float(v), 4)}
        for k, v in facts.metrics.items()
        if k in CARD_METRICS
    ]
    card: dict = {"base_model": donor.model_id, "base_model_relation": "finetune", "library_name": "gguf"}
    if donor.license:
        card["license"] = donor.license
    if ship.data:
        card["datasets"] = [ship.data]
    card["tags"] = ["gguf", "llama.cpp", "smollm-pipeline", *(t for t in (ship.recipe,) if t)]
    card["pipeline_tag"] = "text-generation"
    if results:
        card["metrics"] = sorted({r["type"] for r in results})
        card["model-index"] = [
            {
                "name": facts.file.removesuffix(".gguf"),
                "results": [
                    {
                        "task": {"type": "text-generation"},
                        "dataset": {"name": ship.data or "val split", "type": ship.data or "local"},
                        "metrics": results,
                    }
                ],
            }
        ]
    return card


def article(label: str) -> str:
    """'a' or 'an' before a size label as it is read aloud: an 11M, an 8.4B, an 18M, an 80M, a 135M, a 1.7B."""
    digits = re.match(r"\d+", label)
    if digits is None:
        return "an" if label[:1].lower() in "aeiou" else "a"
    n = digits.group()
    lead = n[: len(n) % 3 or 3]  # the first group of three, as 11,000 is read "eleven thousand"
    return "an" if lead.startswith("8") or lead in ("11", "18") else "a"


def model_card(meta: Metadata, donor: DonorIdentity, ship: ShipInfo, facts: CardFacts) -> str:
    """The whole README.md: front matter, how it was made, how to run it."""
    head = yaml.safe_dump(front_matter(meta, donor, ship, facts), sort_keys=False, allow_unicode=True)
    made = (
        f"a fine-tune ({ship.recipe}) of [{donor.model_id}](https://huggingface.co/{donor.model_id})"
        if ship.finetune
        else f"{article(meta.size_label)} {meta.size_label} student model (recipe `{ship.recipe}`) built from "
        "the weights of "
        f"[{donor.model_id}](https://huggingface.co/{donor.model_id}) and trained further"
    )
    numbers = "".join(f"| {k} | {v:.4f} |\n" for k, v in facts.metrics.items())
    steps = f" {facts.steps} training steps" if facts.steps is not None else ""
    kept = f", the weights of step {facts.kept_step} (lowest validation loss)" if facts.kept_step is not None else ""
    lines = [
        f"---\n{head}---\n",
        f"# {facts.file.removesuffix('.gguf')}\n",
        f"{meta.name}: {made}, on the `{ship.data or 'local'}` data, by smollm-pipeline (DVC + Hydra + MLflow)."
        f"{f' Trained for{steps}{kept}.' if steps else ''} Tensor type: {facts.dtype}. "
        f"License: {donor.license or 'see the base model'} (the base model's).\n",
        "| metric | value |\n|---|---|\n" + numbers if numbers else "",
        "## Run it with llama.cpp\n",
        f"```bash\nllama-cli -m {facts.file} -cnv          # chat in the terminal (the file carries its chat "
        f"template)\nllama-server -m {facts.file} --port 8080   # OpenAI-compatible server\n"
        "pip install 'llama-cpp-python[server]'   # its server needs the extra (plain llama-cpp-python lacks it)\n"
        f"python -m llama_cpp.server --model {facts.file}   # the same from llama-cpp-python\n```\n",
        ""
        if ship.finetune
        else (
            f"It shares its donor's vocabulary id for id, so it can draft for the donor (speculative "
            f"decoding: the donor's own greedy text, fewer donor forwards; evaluate's `draft_*` metrics say how "
            f"often the donor accepts its drafts):\n\n```bash\nllama-server -m {facts.base_file} -md {facts.file} "
            f"--draft-max 4   # {donor.model_id}, drafted by this model\n```\n"
        ),
        "## Run it with transformers\n",
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f'tok = AutoTokenizer.from_pretrained(".", gguf_file="{facts.file}")\n'
        f'model = AutoModelForCausalLM.from_pretrained(".", gguf_file="{facts.file}")  # dequantized to fp32\n```\n',
    ]
    if facts.has_adapters:
        lines.append(
            "## The adapter alone\n\n"
            f"`adapter.gguf` is the LoRA adapter for llama.cpp, on the GGUF it was trained on, `{facts.base_file}` "
            f"(`llama-cli -m {facts.base_file} --lora adapter.gguf`); "
            f'`peft/` is the same adapter for PEFT: `PeftModel.from_pretrained(base, "peft")`, where `base` is '
            f"{donor.model_id} loaded with transformers (its `base_model_name_or_path`). It was trained on the "
            "donor GGUF's dequantized weights, so on the hub's original weights it computes nearly, not exactly, "
            "what the merged file does.\n"
        )
    if facts.mlflow_run_id:
        lines.append(f"Provenance: MLflow run `{facts.mlflow_run_id}` (also in the file's `pipeline.*` keys).\n")
    return "\n".join(line for line in lines if line)
