"""Build a small random Llama that vLLM can serve, with no hub: a ByteLevel BPE tokenizer trained
here on seeded synthetic text, a chat template, and seeded random weights (safetensors, fp32).

The same size, seed and library versions give the same bytes; a model is cached in the models
directory under a name derived from those inputs, with a manifest of the files' SHA-256 sums that
is checked before reuse. Needs torch, transformers and tokenizers (the `[vllm]` extra).

    python -m shadow.realvllm.model --size tiny --seed 0     # prints the model directory
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BUILDER_VERSION = 1  # bump when the bytes for a given (size, seed, versions) change
MANIFEST = "shadow-model.json"
ENV_MODELS_DIR = "SHADOW_MODELS_DIR"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ModelSize:
    """The shape of one model size (head_dim = hidden / heads must be one vLLM's CPU attention has)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    max_positions: int = 2048
    corpus_lines: int = 20_000
    experts: int = 0  # > 0: a Mixtral-style MoE (this many experts per layer, 2 routed per token)

    def key(self) -> dict[str, int]:
        """The shape as the cache key and manifest name it (`experts` only when the model has some,
        so the dense sizes keep their keys)."""
        d = asdict(self)
        if not self.experts:
            del d["experts"]
        return d


SIZES: dict[str, ModelSize] = {
    # ~1.5 M parameters: steps of 2-5 ms on one core; for tests
    "tiny": ModelSize(vocab=4096, hidden=128, layers=2, heads=4, kv_heads=2),
    # ~36 M parameters: steps of ~17-25 ms on one core, like a real decode step
    "mid": ModelSize(vocab=4096, hidden=512, layers=8, heads=8, kv_heads=4),
    # ~2.7 M parameters, 4 experts per layer (top-2): the MoE whose DP ranks vLLM steps in lockstep
    "moe": ModelSize(vocab=4096, hidden=128, layers=2, heads=4, kv_heads=2, experts=4),
}


def default_models_dir() -> Path:
    """$SHADOW_MODELS_DIR, else ~/.cache/shadow/models."""
    env = os.environ.get(ENV_MODELS_DIR)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shadow" / "models"


def library_versions() -> dict[str, str]:
    """The versions whose output bytes the model depends on."""
    import tokenizers
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__}


def cache_key(size: str, seed: int, versions: dict[str, str]) -> str:
    """The cache directory name for these inputs: `<size>-s<seed>-<12 hex>`."""
    spec = {"builder": BUILDER_VERSION, "size": SIZES[size].key(), "seed": seed, "versions": versions}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    return f"{size}-s{seed}-{digest}"


def corpus(seed: int, lines: int) -> Iterator[str]:
    """Seeded text with word-like pieces, punctuation and numbers, so BPE learns real merges."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
              "st", "tr", "pl", "ch", "sh", "th", "gr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ck", "ng"]
    lexicon = sorted({
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
        for _ in range(1500)
    })
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]  # Zipf-like word frequencies
    for _ in range(lines):
        words = rng.choices(lexicon, weights, k=rng.randint(3, 18))
        line = " ".join(words).capitalize() + rng.choice([".", ",", "?", "!", ";"])
        if rng.random() < 0.5:
            line += f" {rng.randint(0, 99999)}"
        yield line


def verify(path: Path) -> bool:
    """True when `path` holds a complete model whose files match its manifest."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        return all(_sha256(path / name) == digest for name, digest in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def ensure_model(size: str = "tiny", seed: int = 0, models_dir: Path | None = None,
                 log: bool = True) -> Path:
    """The cached model for (size, seed), built first if it is missing or does not verify."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r} (known: {', '.join(SIZES)})")
    root = models_dir or default_models_dir()
    target = root / cache_key(size, seed, library_versions())
    if verify(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    tmp.chmod(0o755)
    try:
        if log:
            print(f"shadow: building the {size} model (seed {seed}) in {target}", file=sys.stderr)
        build(tmp, size, seed)
        if target.exists():  # a broken copy (or a concurrent builder's): replace it
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            if not verify(target):  # another builder won the race with a good copy otherwise
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build(out: Path, size: str, seed: int) -> dict[str, object]:
    """Write tokenizer, chat template, config and weights for (size, seed) into `out`; the manifest."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    spec = SIZES[size]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # any byte encodes: no <unk>
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    bpe.train_from_iterator(corpus(seed, spec.corpus_lines), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=list(SPECIAL_TOKENS[4:]), model_max_length=spec.max_positions,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)

    vocab = -(-len(tok) // 64) * 64  # embedding rows rounded up; ids past the tokenizer are never sampled
    common: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=4 * spec.hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, head_dim=spec.hidden // spec.heads,
        max_position_embeddings=spec.max_positions, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    if spec.experts:
        from transformers import MixtralConfig, MixtralForCausalLM

        moe = MixtralConfig(**common, num_local_experts=spec.experts, num_experts_per_tok=2)
        model = MixtralForCausalLM(moe).to(torch.float32)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common)).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)

    files = {p.name: _sha256(p) for p in sorted(out.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest: dict[str, object] = {
        "size": size, "seed": seed, "builder": BUILDER_VERSION, "shape": spec.key(),
        "parameters": sum(p.numel() for p in model.parameters()), "tokenizer_vocab": len(tok),
        "versions": library_versions(), "files": files,
        "content_sha256": hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest(),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m shadow.realvllm.model",
        description="Build (or find in the cache) a random Llama + local tokenizer for vLLM; prints "
        "its directory. Deterministic: the same size, seed and library versions give the same bytes.",
    )
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny",
                    help="tiny (fast, tests), mid (~20 ms steps) or moe (tiny with 4 experts per layer)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the corpus and weights (default 0)")
    ap.add_argument("--models-dir", type=Path, default=None,
                    help=f"cache directory (default ${ENV_MODELS_DIR} or ~/.cache/shadow/models)")
    ap.add_argument("--out", type=Path, default=None,
                    help="build into this directory instead of the cache (it must not exist)")
    args = ap.parse_args(argv)
    if args.out is not None:
        if args.out.exists():
            print(f"{args.out} exists; choose a new directory", file=sys.stderr)
            return 2
        args.out.mkdir(parents=True)
        manifest = build(args.out, args.size, args.seed)
        print(args.out)
        print(f"content sha256 {manifest['content_sha256']}", file=sys.stderr)
        return 0
    print(ensure_model(args.size, args.seed, args.models_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
