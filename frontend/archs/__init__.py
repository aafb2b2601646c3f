"""The registry: `general.architecture` -> the file that describes that architecture's math."""

from types import ModuleType

from . import (
    deepseek4,
    deepseek32,
    gemma2,
    gemma3,
    glm_dsa,
    gpt_oss,
    hy_v3,
    kimi_k3,
    lfm2,
    llama,
    minimax_m3,
    mistral3,
    phi3,
    qwen2,
    qwen3,
    qwen3moe,
    qwen3next,
    qwen4exp,
    qwen35,
    smollm3,
)

ARCHITECTURES: dict[str, ModuleType] = {
    "deepseek32": deepseek32,
    "deepseek4": deepseek4,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "glm-dsa": glm_dsa,
    "gpt-oss": gpt_oss,
    "hy_v3": hy_v3,
    "kimi-k3": kimi_k3,
    "lfm2": lfm2,
    "llama": llama,
    "minimax-m3": minimax_m3,
    "mistral3": mistral3,
    "phi3": phi3,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "qwen35": qwen35,
    "qwen3moe": qwen3moe,
    "qwen3next": qwen3next,
    "qwen4exp": qwen4exp,
    "smollm3": smollm3,
}
