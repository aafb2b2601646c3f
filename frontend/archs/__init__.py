"""The registry: `general.architecture` -> the file that describes that architecture's math."""

from types import ModuleType

from . import llama, qwen3, qwen3moe

ARCHITECTURES: dict[str, ModuleType] = {
    "llama": llama,
    "qwen3": qwen3,
    "qwen3moe": qwen3moe,
}
