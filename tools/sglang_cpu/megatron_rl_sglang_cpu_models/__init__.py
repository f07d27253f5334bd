"""The model classes SGLang's registry loads first in a CPU engine (SGLANG_EXTERNAL_MODEL_PACKAGE, set by
megatron_rl_sglang_cpu in the server process): SGLang's own Llama and Qwen-3 classes, re-exported. An
architecture not here makes the registry import all of SGLang's model modules, as it does without this package."""
