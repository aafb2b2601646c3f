"""Deterministic tiny GGUF models for every registered architecture, written by the project.

`write_fixture("llama", path, seed=0)` writes a random-weight model that `load_model` accepts:
every tensor the architecture file reads, with the shapes it checks, and nothing more. The tensor
list is not written down here: the architecture file is run against a weight source that records
what it reads (declared_tensors.py); this file supplies the keys, which optional tensors are
present, how values are drawn and the storage types. Options switch on the optional paths
(biases, per-tensor `.scale`, `rope_freqs`, untied output, MoE, quantized weights, a GPT-2 BPE
vocabulary) so tests can exercise each one.

Values: matrices, embeddings and biases are N(0, 0.1) (as llama.cpp's own fixtures); norm gammas
and `.scale` multipliers are 1 + N(0, 0.1) so activations keep a useful size through the layers;
`rope_freqs` are llama3-like factors in [1, 4). Each tensor draws from its own generator seeded by
(seed, crc32(name)), so a tensor's values do not depend on which other tensors an option adds.
The same arguments always give a byte-identical file.

Adding an architecture is one `ArchRecipe` entry in `RECIPES` and the keys its fixture carries
(`_write_hparams`, or a `fixtures_<family>.py` beside this file for a family with many keys).
"""

from __future__ import annotations

import os
import re
import zlib
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ggufc.frontend.blocks import SUPPORTED_QTYPES
from tests.support import fixtures_bailingmoe3 as bailing
from tests.support import fixtures_deepseek4 as compressed
from tests.support import fixtures_deepseek32 as latent
from tests.support import fixtures_kimi_k3 as kimi
from tests.support import fixtures_minimax_m3 as msa
from tests.support import fixtures_qwen4exp as hyperconnected
from tests.support.declared_tensors import Declared, Presence, declared_tensors
from tests.support.fixture_spec import FixtureOptions, FixtureSize, TensorSpec, resolve_size
from tests.support.fixtures_qwen35 import rope_dimension_count, write_hybrid_hparams

# ---------------------------------------------------------------------------------------------
# architectures


@dataclass(frozen=True)
class ArchRecipe:
    """The keys an architecture's fixture carries beyond the common llama skeleton (its tensors are
    the ones the architecture file reads: declared_tensors.py)."""

    moe: str  # "never", "optional" or "always"
    expert_gate_optional: bool = False  # MoE without ffn_gate_exps (silu(up) only)
    expert_ff_key: bool = False  # writes {arch}.expert_feed_forward_length
    hybrid: bool = False  # gated delta-net + gated attention layers (fixtures_qwen35.py)
    hyper: bool = False  # qwen4exp: hyper-connections, QSA, PLE (fixtures_qwen4exp.py)
    compressed: bool = False  # deepseek4: Sinkhorn HC, compressed attention (fixtures_deepseek4.py)
    latent: bool = False  # MLA + the DSA indexer + sigmoid MoE (fixtures_deepseek32.py)
    # hy_v3: layer 0 dense (when there are others), the others a sigmoid MoE selected by probs +
    # exp_probs_b with an ungated shared expert of n_ff / 2, weights renormalised and scaled
    biased_moe: bool = False
    msa: bool = False  # minimax-m3: leading dense block, MoE blocks with MSA (fixtures_minimax_m3.py)
    kimi: bool = False  # KDA + rope-less MLA, residual attention, latent MoE (fixtures_kimi_k3.py)
    # minimax-01: lightning-attention layers between softmax layers (every other layer, layer 0
    # lightning), post-norm residuals times this residual_scale
    lightning_residual_scale: float = 0.0
    bailing: bool = False  # KDA + MLA without Q-LoRA, SwiGLU clamped after the SiLU (fixtures_bailingmoe3.py)
    # a sliding window of this many cells on every other layer (layer 0 windowed), so that a
    # dozen tokens already reach past it
    window: int = 0
    softcaps: tuple[float, float] | None = None  # attention-score and final-logit softcaps small enough to bite
    granite: bool = False  # embedding, attention, residual and logit multipliers; MoE with a shared expert
    logit_scale: float = 0.0  # written as {arch}.logit_scale when set (muse-glimmer multiplies by it)
    # YaRN (factor, original context, yarn_log_multiplier) and the query temperature β, with an
    # original context short enough that a dozen tokens pass the first temperature step
    yarn: tuple[float, int, float] | None = None
    temperature: float = 0.0
    # LongRoPE: the original context (below the fixture's, so the long factors apply) and the
    # rope.scaling.attn_factor magnitude; rope over 3/4 of the head dim (Phi-4-mini's partial rotary)
    longrope: tuple[int, float] | None = None
    partial_rope: bool = False
    # lfm2: odd layers are gated short convolutions of this kernel (head_count_kv 0 there)
    short_conv: int = 0


RECIPES: dict[str, ArchRecipe] = {
    "llama": ArchRecipe(moe="optional", expert_gate_optional=True),
    "gemma2": ArchRecipe(moe="never", window=4, softcaps=(0.5, 2.0)),
    "gemma3": ArchRecipe(moe="never", window=4),
    "qwen2": ArchRecipe(moe="never"),
    "smollm3": ArchRecipe(moe="never"),
    "mistral3": ArchRecipe(moe="optional", yarn=(4.0, 8, 1.0), temperature=0.5),
    "phi3": ArchRecipe(moe="never", longrope=(32, 1.19), partial_rope=True),
    "lfm2": ArchRecipe(moe="never", window=4, short_conv=3),
    # YaRN 32 over 8 positions with its magnitude kept (no yarn_log_multiplier): 1 + 0.1 ln 32 on q and k
    "gpt-oss": ArchRecipe(moe="always", expert_ff_key=True, window=4, yarn=(32.0, 8, 0.0)),
    "qwen3": ArchRecipe(moe="never"),
    "qwen3moe": ArchRecipe(moe="always", expert_ff_key=True),
    "qwen35": ArchRecipe(moe="never", hybrid=True),
    "qwen3next": ArchRecipe(moe="always", expert_ff_key=True, hybrid=True),
    "qwen4exp": ArchRecipe(moe="always", expert_ff_key=True, hyper=True),
    "deepseek4": ArchRecipe(moe="always", compressed=True),
    "deepseek32": ArchRecipe(moe="always", latent=True),
    "glm-dsa": ArchRecipe(moe="always", latent=True),
    "granite": ArchRecipe(moe="optional", granite=True),
    "granitemoe": ArchRecipe(moe="always", granite=True),
    "granite_swa": ArchRecipe(moe="optional", granite=True, window=4),
    "exaone4": ArchRecipe(moe="never"),
    "muse-glimmer": ArchRecipe(moe="never", window=4, logit_scale=1.5),
    "hy_v3": ArchRecipe(moe="always", expert_ff_key=True, biased_moe=True),
    "minimax-m3": ArchRecipe(moe="always", msa=True),
    "kimi-k3": ArchRecipe(moe="always", kimi=True),
    "minimax-01": ArchRecipe(moe="always", partial_rope=True, lightning_residual_scale=1.75),
    "bailingmoe3": ArchRecipe(moe="always", bailing=True),
}
GRANITE_MULTIPLIERS = (1.5, 0.1, 0.5, 3.0)  # embedding, attention, residual, logit (divides)
BIASED_MOE_WEIGHTS_SCALE = 2.5  # hy_v3 fixtures: expert_weights_scale (with expert_weights_norm true)


def _is_moe(recipe: ArchRecipe, opts: FixtureOptions, arch: str) -> bool:
    if opts.moe is None:
        return recipe.moe == "always"
    if opts.moe and recipe.moe == "never":
        raise ValueError(f"{arch} has no MoE variant")
    if not opts.moe and recipe.moe == "always":
        raise ValueError(f"{arch} is always MoE")
    return opts.moe


def _has_moe_layers(arch: str, s: FixtureSize, opts: FixtureOptions) -> bool:
    """MoE, and more layers than minimax-m3's leading dense block (one layer: no expert keys)."""
    moe = _is_moe(_recipe(arch), opts, arch)
    return moe and not (RECIPES[arch].msa and s.n_layer <= msa.N_DENSE_LEAD)


def _recipe(arch: str) -> ArchRecipe:
    try:
        return RECIPES[arch]
    except KeyError:
        raise ValueError(f"no fixture recipe for architecture {arch!r} (have {', '.join(RECIPES)})") from None


# ---------------------------------------------------------------------------------------------
# the tensor plan: what the architecture file reads from a model with the fixture's keys


def _layer_and_name(name: str) -> tuple[int | None, str]:
    """blk.3.attn_q.weight -> (3, "attn_q.weight"); a model-level tensor has no layer."""
    parts = name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit():
        return int(parts[1]), parts[2]
    return None, name


def _optional_present(short: str, opts: FixtureOptions) -> bool:
    """Which optional tensors (and which probed layouts) a fixture has, from its options (a `.scale`
    or `.bias` only beside its matrix: `_presence`)."""
    if short == "output.weight":
        return not opts.tied_output
    if short == "rope_freqs.weight":
        return opts.rope_freqs
    if short == "ffn_gate_exps.weight":
        return opts.expert_gate
    if short == "output.scale":  # the `.scale` option is for the projections and experts
        return False
    if short == "ssm_in.weight":  # the legacy fused delta-net input: fixtures use attn_qkv + attn_gate
        return False
    if short.endswith(".scale"):
        return opts.scales
    if short.endswith(".bias"):
        return opts.biases
    return True


def _presence(arch: str, s: FixtureSize, opts: FixtureOptions) -> Presence:
    def present(name: str, read: Collection[str]) -> bool:
        layer, short = _layer_and_name(name)
        if arch == "hy_v3" and short == "ffn_gate_inp.weight":  # layer 0 dense when there are others
            return not (layer == 0 < s.n_layer - 1)
        if short.startswith("exp_probs_b"):  # the routing's selection bias: part of the architecture
            return True
        if name.endswith((".scale", ".bias")) and name.rsplit(".", 1)[0] + ".weight" not in read:
            return False  # only beside its matrix: no gate scale beside a merged gate_up
        return _optional_present(short, opts)

    return present


def value_kind(arch: str, d: Declared) -> str:
    """How a tensor's values are drawn and stored (see `tensor_values`, `storage_type`)."""
    _, short = _layer_and_name(d.name)
    if d.qtype == "I32":
        return "expert_ids"
    if short in KIND_OVERRIDES.get(arch, {}):
        return KIND_OVERRIDES[arch][short]
    stem = short.removesuffix(".weight")
    if short in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        return "rope_freqs"
    if short == "ssm_a":
        return "ssm_a"
    if short == "exp_probs_b":
        return "selection_bias"
    if short.endswith(".scale") or stem.endswith("_scale"):
        return "scale"
    if short.endswith(".weight") and ("norm" in stem or stem.endswith("_res_score")):
        return "norm"
    if short.endswith(".bias") or stem.endswith(("_base", "_ape", "attn_sinks")):
        return "bias"
    if stem.startswith("ffn_gate_inp"):
        return "router"
    if "conv1d" in stem:
        return "conv"
    if d.qtype == "F32":  # the architecture reads it as F32 only: never quantized
        return "f32"
    return "matrix"


KIND_OVERRIDES: dict[str, dict[str, str]] = {"kimi-k3": kimi.VALUE_KINDS, "bailingmoe3": bailing.VALUE_KINDS}

FILE_HEAD = ("token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight")


def _file_order(d: Declared, index: int) -> tuple[int, int, int]:
    """The model-level tensors first (the embedding and output ones leading), then layer by layer,
    each in the order the architecture reads them."""
    layer, _ = _layer_and_name(d.name)
    if layer is not None:
        return (2, layer, index)
    return (0, FILE_HEAD.index(d.name), 0) if d.name in FILE_HEAD else (1, index, 0)


def _keys(writer: gguf.GGUFWriter) -> dict[str, Any]:
    return {key: v.value for key, v in writer.kv_data[0].items()}


def _declared(arch: str, s: FixtureSize, opts: FixtureOptions, keys: dict[str, Any]) -> list[Declared]:
    found = declared_tensors(arch, {**keys, "general.architecture": arch}, s.vocab, _presence(arch, s, opts))
    if opts.rope_freqs and "rope_freqs.weight" not in {d.name for d in found.tensors}:
        raise ValueError(f"{arch} has no rope_freqs tensor")
    if not opts.expert_gate and not any(n.endswith(".ffn_gate_exps.weight") for n in found.absent):
        raise ValueError(f"{arch} needs ffn_gate_exps (expert_gate=False is for llama MoE only)")
    return found.tensors


def plan_tensors(arch: str, size: FixtureSize, opts: FixtureOptions) -> list[TensorSpec]:
    """Every tensor of the fixture, in file order: the tensors the architecture file reads."""
    writer = gguf.GGUFWriter(None, arch)
    _write_hparams(writer, arch, size, opts, moe=_has_moe_layers(arch, size, opts))
    return _plan(arch, size, opts, _keys(writer))


def _plan(arch: str, s: FixtureSize, opts: FixtureOptions, keys: dict[str, Any]) -> list[TensorSpec]:
    if opts.tokenizer not in ("none", "gpt2"):
        raise ValueError(f"unknown tokenizer {opts.tokenizer!r} (have 'none', 'gpt2')")
    declared = _declared(arch, s, opts, keys)
    ordered = sorted(enumerate(declared), key=lambda item: _file_order(item[1], item[0]))
    return [TensorSpec(d.name, d.shape, value_kind(arch, d)) for _, d in ordered]


def full_options(arch: str) -> dict[str, bool]:
    """write_fixture options that switch on every optional tensor `arch` knows (as llama.cpp's own
    fixtures have them): biases, `.scale` multipliers, rope_freqs where it exists, untied output."""
    opts = {"biases": True, "scales": True, "tied_output": False}
    try:
        plan_tensors(arch, resolve_size("tiny"), FixtureOptions(rope_freqs=True))
    except ValueError:
        return opts
    return {**opts, "rope_freqs": True}


# ---------------------------------------------------------------------------------------------
# values and storage


def tensor_values(spec: TensorSpec, seed: int) -> np.ndarray:
    """The float32 values of one tensor (its own generator: independent of the other tensors)."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    if spec.kind in ("norm", "scale"):
        return (1.0 + 0.1 * rng.standard_normal(spec.shape)).astype(np.float32)
    if spec.kind == "rope_freqs":
        return rng.uniform(1.0, 4.0, spec.shape).astype(np.float32)
    if spec.kind == "selection_bias":  # large enough to change which experts are picked
        return (0.5 * rng.standard_normal(spec.shape)).astype(np.float32)
    if spec.kind == "ssm_a":  # stored as -exp(A_log): negative decay rates
        return (-np.exp(0.3 * rng.standard_normal(spec.shape))).astype(np.float32)
    return (0.1 * rng.standard_normal(spec.shape)).astype(np.float32)


# the types gguf-py cannot quantize: blocks are synthesised. Per type: byte offset and typical size
# of the f16 scale d (so the decoded values are roughly N(0, 0.1)), then the offset of the f16 block
# minimum dmin and its ratio to d (None: no minimum)
SYNTHESISED: dict[str, tuple[int, float, int | None, float]] = {
    "Q6_K": (208, 7.3e-5, None, 0.0),  # d * sc(int8) * (q - 32): E|sc*(q-32)| ~ 1370
    # d * sc * q - dmin * m with sc, m in [0, 64), q in [0, 16) (or [0, 32) for Q5_K): dmin = mean(q) d
    # centres the sub-blocks around zero on average
    "Q4_K": (0, 4.6e-4, 2, 7.5),
    "Q5_K": (0, 2.3e-4, 2, 15.5),
    "Q2_K": (80, 7e-3, 82, 1.5),  # d * sc * q - dmin * m with sc, m in [0, 16), q in [0, 4)
    "Q3_K": (108, 2.3e-3, None, 0.0),  # d * (sc - 32) * (q - 4), sc in [0, 64), q in [0, 8)
    "IQ4_NL": (0, 1.5e-3, None, 0.0),  # d * table[q], rms(table) ~ 67
    "IQ4_XS": (0, 8e-5, None, 0.0),  # d * (sc - 32) * table[q], sc in [0, 64)
}


def storage_type(spec: TensorSpec, qtype: str) -> str:
    """The GGML type a tensor is written in: only matrices whose rows fill whole blocks are quantized
    (like llama.cpp's quantizer, which falls back for odd rows); norms, biases, scales, the router
    and rope_freqs stay F32."""
    if spec.kind != "matrix" or qtype == "F32":
        return "F32"
    block, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    return qtype if spec.shape[-1] % block == 0 else "F32"


def encode_tensor(spec: TensorSpec, values: np.ndarray, qtype: str, seed: int) -> np.ndarray:
    """Storage array for GGUFWriter.add_tensor: f32 values, f16 values or uint8 block rows.

    Blocks of the SYNTHESISED types are made from (seed, name) and do not encode `values`: read the
    decoded weights back with gguf.quants.dequantize."""
    if qtype == "F32":
        return values
    if qtype in SYNTHESISED:
        return _random_blocks(spec, qtype, seed)
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])


def _random_blocks(spec: TensorSpec, qtype: str, seed: int) -> np.ndarray:
    """Valid blocks: random quants and sub-scales, f16 scales chosen so the decoded values are
    finite and roughly N(0, 0.1)."""
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    *lead, k = spec.shape
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode()), 1])
    blocks = rng.integers(0, 256, (*lead, k // block, type_size), dtype=np.uint8)
    jitter = rng.uniform(0.75, 1.25, blocks.shape[:-1])
    d_at, d_size, min_at, min_ratio = SYNTHESISED[qtype]
    d = d_size * jitter
    _put_f16(blocks, d_at, d)
    if min_at is not None:
        _put_f16(blocks, min_at, min_ratio * d)
    return blocks.reshape(*lead, -1)


def _put_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[..., offset : offset + 2] = values.astype(np.float16)[..., None].view(np.uint8)


# ---------------------------------------------------------------------------------------------
# a tiny GPT-2 byte-level BPE vocabulary

BPE_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello world! This is a tiny model written by the "
    "ggufc test fixtures; it knows only a few merges, but every byte has a token. Numbers 0123456789 "
    "and tokens: the, then, there, these, those, this, that, other, another, mother, brother."
)
EOS_TOKEN = "<|endoftext|>"
_WORD_RE = re.compile(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+")
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


@dataclass(frozen=True)
class BpeVocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    eos_id: int


def gpt2_vocab(n_vocab: int) -> BpeVocab:
    """256 byte tokens, merges learnt greedily from `BPE_CORPUS`, unused fillers, then `<|endoftext|>`."""
    if n_vocab < 257:
        raise ValueError(f"a gpt2 vocabulary needs n_vocab >= 257 (256 bytes + eos), got {n_vocab}; "
                         "use size='bpe' or a FixtureSize with a larger vocab")
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = _learn_merges(b2u, n_vocab - 257)
    tokens += ["".join(m.split(" ")) for m in merges]
    n_fill = n_vocab - 1 - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(n_fill)]
    types = [TOKEN_NORMAL] * (256 + len(merges)) + [TOKEN_UNUSED] * n_fill + [TOKEN_CONTROL]
    return BpeVocab(tokens + [EOS_TOKEN], types, merges, eos_id=n_vocab - 1)


def _learn_merges(b2u: dict[int, str], limit: int) -> list[str]:
    words = Counter(tuple(b2u[b] for b in w.encode()) for w in _WORD_RE.findall(BPE_CORPUS))
    known: set[str] = {b2u[b] for b in range(256)}
    merges: list[str] = []
    while len(merges) < limit:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        candidates = [(-c, p) for p, c in pairs.items() if "".join(p) not in known]
        if not candidates:
            break
        _, best = min(candidates)  # most frequent; ties broken by the pair's text, for determinism
        merges.append(f"{best[0]} {best[1]}")
        known.add("".join(best))
        words = Counter({_merge_pair(w, best): c for w, c in words.items()})
    return merges


def _merge_pair(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# writing


def write_fixture(
    arch: str, path: str | os.PathLike[str], *, seed: int = 0, size: str | FixtureSize = "tiny",
    qtype: str = "F32", biases: bool = False, scales: bool = False, rope_freqs: bool = False,
    tied_output: bool = False, moe: bool | None = None, expert_gate: bool = True,
    rope_scaling: float | None = None, tokenizer: str = "none", chat_template: str | None = None,
    rms_eps: float = 1e-5, rope_base: float = 10000.0,
) -> Path:
    """Write a random-weight `arch` model to `path` and return the path.

    `qtype` is the storage type of the weight matrices (token_embd, output, projections, experts);
    see `storage_type` for what stays F32. Options that an architecture does not have raise
    ValueError (e.g. rope_freqs for qwen3, moe=False for qwen3moe).
    """
    if qtype not in SUPPORTED_QTYPES:
        raise ValueError(f"unsupported qtype {qtype!r} (have {', '.join(SUPPORTED_QTYPES)})")
    fs = resolve_size(size)
    opts = FixtureOptions(biases=biases, scales=scales, rope_freqs=rope_freqs, tied_output=tied_output,
                          moe=moe, expert_gate=expert_gate, rope_scaling=rope_scaling, tokenizer=tokenizer,
                          chat_template=chat_template, rms_eps=rms_eps, rope_base=rope_base)
    moe = _has_moe_layers(arch, fs, opts)
    vocab = gpt2_vocab(fs.vocab) if tokenizer == "gpt2" else None
    out = Path(path)
    writer = gguf.GGUFWriter(os.fspath(out), arch)  # nothing reaches the file before the tensors are planned
    _write_hparams(writer, arch, fs, opts, moe=moe)
    specs = _plan(arch, fs, opts, _keys(writer))
    _write_tokenizer(writer, opts, vocab)
    for spec in specs:
        if spec.kind == "expert_ids":
            writer.add_tensor(spec.name, compressed.expert_ids(spec, seed, fs.n_expert))
            continue
        _add_tensor(writer, spec, seed, storage_type(spec, qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tensor(writer: gguf.GGUFWriter, spec: TensorSpec, seed: int, qtype: str) -> None:
    data = encode_tensor(spec, tensor_values(spec, seed), qtype, seed)
    raw_dtype = None if qtype == "F32" else gguf.GGMLQuantizationType[qtype]
    writer.add_tensor(spec.name, data, raw_dtype=raw_dtype)


def _write_hparams(w: gguf.GGUFWriter, arch: str, s: FixtureSize, opts: FixtureOptions, *, moe: bool) -> None:
    w.add_name(f"ggufc-fixture-{arch}")
    if RECIPES[arch].compressed:
        compressed.write_hparams(w, s, opts)
        w.add_vocab_size(s.vocab)
        return
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    if RECIPES[arch].kimi:  # per-layer kv heads (0: KDA), MLA's lengths, KDA, residual attention
        w.add_head_count(s.n_head)
        w.add_layer_norm_rms_eps(opts.rms_eps)
        kimi.write_hparams(w, s)
        w.add_vocab_size(s.vocab)
        return
    if RECIPES[arch].bailing:  # per-layer kv heads (0: KDA), MLA's lengths, KDA, clamps
        w.add_head_count(s.n_head)
        w.add_layer_norm_rms_eps(opts.rms_eps)
        w.add_rope_freq_base(opts.rope_base)
        if opts.rope_scaling is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(opts.rope_scaling)
        bailing.write_hparams(w, s)
        w.add_vocab_size(s.vocab)
        return
    if RECIPES[arch].latent:  # MLA's own key/value lengths and rope part
        w.add_head_count(s.n_head)
        w.add_layer_norm_rms_eps(opts.rms_eps)
        w.add_rope_freq_base(opts.rope_base)
        if opts.rope_scaling is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(opts.rope_scaling)
        latent.write_hparams(w, arch, s)
        w.add_vocab_size(s.vocab)
        return
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    if RECIPES[arch].short_conv:
        w.add_array(f"{arch}.attention.head_count_kv", [0 if il % 2 else s.n_head_kv for il in range(s.n_layer)])
        w.add_uint32(f"{arch}.shortconv.l_cache", RECIPES[arch].short_conv)
    else:
        w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    if RECIPES[arch].hybrid:

        w.add_rope_dimension_count(rope_dimension_count(arch, s))
    elif RECIPES[arch].msa:
        w.add_rope_dimension_count(msa.rope_dimension_count(s))
    else:
        w.add_rope_dimension_count(s.head_dim * 3 // 4 if RECIPES[arch].partial_rope else s.head_dim)
    w.add_layer_norm_rms_eps(opts.rms_eps)
    w.add_rope_freq_base(opts.rope_base)
    if opts.rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(opts.rope_scaling)
    if moe:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        if RECIPES[arch].expert_ff_key:
            w.add_expert_feed_forward_length(s.n_ff)
        if RECIPES[arch].biased_moe:
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length", s.n_ff // 2)
            w.add_uint32(f"{arch}.expert_gating_func", 2)
            w.add_bool(f"{arch}.expert_weights_norm", True)
            w.add_float32(f"{arch}.expert_weights_scale", BIASED_MOE_WEIGHTS_SCALE)
    if RECIPES[arch].hybrid:

        write_hybrid_hparams(w, arch, s, moe=moe)
    if RECIPES[arch].hyper:

        hyperconnected.write_hparams(w, s)
    if RECIPES[arch].msa:
        msa.write_hparams(w, s)
    _write_window(w, arch)
    if RECIPES[arch].logit_scale:
        w.add_float32(f"{arch}.logit_scale", RECIPES[arch].logit_scale)
    if RECIPES[arch].granite:
        _write_granite_multipliers(w, arch, s, moe=moe)
    if RECIPES[arch].lightning_residual_scale:
        w.add_float32(f"{arch}.residual_scale", RECIPES[arch].lightning_residual_scale)
        # one layer: softmax (a lone lightning layer's decay scale divides by n_layer - 1 = 0)
        w.add_full_attention_interval(2 if s.n_layer > 1 else 1)
    w.add_vocab_size(s.vocab)


def _write_granite_multipliers(w: gguf.GGUFWriter, arch: str, s: FixtureSize, *, moe: bool) -> None:
    """Every multiplier away from 1 (and from llama.cpp's 1/sqrt(D)) so that each one shows."""
    w.add_float32(f"{arch}.embedding_scale", GRANITE_MULTIPLIERS[0])
    w.add_float32(f"{arch}.attention.scale", GRANITE_MULTIPLIERS[1])
    w.add_float32(f"{arch}.residual_scale", GRANITE_MULTIPLIERS[2])
    w.add_float32(f"{arch}.logit_scale", GRANITE_MULTIPLIERS[3])
    if moe:
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", s.n_ff // 2)
    if arch == "granite_swa":  # NoPE on the odd (full-attention) layers
        w.add_array(f"{arch}.attention.rope_pattern", [il % 2 == 0 for il in range(s.n_layer)])


def _write_window(w: gguf.GGUFWriter, arch: str) -> None:
    recipe = RECIPES[arch]
    if recipe.window:
        w.add_sliding_window(recipe.window)
        w.add_array(f"{arch}.attention.sliding_window_pattern", [il % 2 == 0 for il in range(w_layers(w, arch))])
    if recipe.softcaps is not None:
        w.add_float32(f"{arch}.attn_logit_softcapping", recipe.softcaps[0])
        w.add_float32(f"{arch}.final_logit_softcapping", recipe.softcaps[1])
    if recipe.yarn is not None and f"{arch}.rope.scaling.type" not in _keys(w):  # unless linear was asked for
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(recipe.yarn[0])
        w.add_rope_scaling_orig_ctx_len(recipe.yarn[1])
        w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", recipe.yarn[2])
    if recipe.longrope is not None:
        w.add_rope_scaling_orig_ctx_len(recipe.longrope[0])
        w.add_rope_scaling_attn_factors(recipe.longrope[1])
    if recipe.temperature:
        w.add_float32(f"{arch}.attention.temperature_scale", recipe.temperature)


def w_layers(w: gguf.GGUFWriter, arch: str) -> int:
    return int(_keys(w)[f"{arch}.block_count"])


def _write_tokenizer(w: gguf.GGUFWriter, opts: FixtureOptions, vocab: BpeVocab | None) -> None:
    if vocab is None:
        w.add_tokenizer_model("none")
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(vocab.tokens)
        w.add_token_types(vocab.token_types)
        w.add_token_merges(vocab.merges)
        w.add_bos_token_id(vocab.eos_id)
        w.add_eos_token_id(vocab.eos_id)
        w.add_add_bos_token(False)
    if opts.chat_template is not None:
        w.add_chat_template(opts.chat_template)
