"""Config facts of well-known architectures, for ``radixkv plan`` without a config file.

Each entry holds the transformers ``config.json`` fields that size the KV cache (the same names,
so :func:`radixkv.obs.plan.KVSpec.from_config` reads an entry and a real config alike), the
model's parameter count (its weights, for "what fits after the weights"), and ``source``: the
``config.json`` the fields were copied from (the Hugging Face repository of the model, ``main``
branch) and, for the parameter count, the model card or technical report that states it.
"""

from __future__ import annotations

__all__ = ["ARCHITECTURES", "ALIASES"]

ARCHITECTURES: dict[str, dict] = {
    "llama-2-7b": dict(
        name="Llama-2-7B",
        attention="MHA",
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        hidden_size=4096,
        max_position_embeddings=4096,
        num_parameters=6_738_415_616,
        source="https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json; "
        "parameters: model.safetensors.index.json total_size 13,476,839,424 bytes (float16) / 2",
    ),
    "llama-3-8b": dict(
        name="Llama-3-8B",
        attention="GQA",
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        max_position_embeddings=8192,
        num_parameters=8_030_261_248,
        source="https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json; "
        "parameters: model.safetensors.index.json total_size 16,060,522,496 bytes (bfloat16) / 2",
    ),
    "llama-3-70b": dict(
        name="Llama-3-70B",
        attention="GQA",
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        hidden_size=8192,
        max_position_embeddings=8192,
        num_parameters=70_553_706_496,
        source="https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json; "
        "parameters: model.safetensors.index.json total_size 141,107,412,992 bytes (bfloat16) / 2",
    ),
    "mistral-7b": dict(
        name="Mistral-7B-v0.1",
        attention="GQA + sliding window",
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        sliding_window=4096,
        max_position_embeddings=32768,
        num_parameters=7_241_732_096,
        source="https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json (sliding_window 4096, "
        "every layer); parameters: model.safetensors.index.json total_size 14,483,464,192 bytes (bfloat16) / 2",
    ),
    "qwen2.5-7b": dict(
        name="Qwen2.5-7B",
        attention="GQA",
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        hidden_size=3584,
        sliding_window=131072,
        use_sliding_window=False,
        max_position_embeddings=131072,
        num_parameters=7_615_616_512,
        source="https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json (use_sliding_window false); "
        "parameters: model card, 7.61B",
    ),
    "deepseek-v3": dict(
        name="DeepSeek-V3",
        attention="MLA",
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        hidden_size=7168,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=163840,
        num_parameters=671_000_000_000,
        source="https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json; parameters: "
        "DeepSeek-V3 technical report (arXiv:2412.19437), 671B total (the repository adds 14B of MTP module)",
    ),
    "smollm2-135m": dict(
        name="SmolLM2-135M-Instruct",
        attention="GQA",
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=576,
        max_position_embeddings=8192,
        num_parameters=134_515_008,
        source="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json (also the "
        "config of the GGUF radixkv ships); parameters: counted from the loaded weights (tied embeddings)",
    ),
}
"""Key -> config facts (see the module docstring)."""

ALIASES: dict[str, str] = {
    "llama2-7b": "llama-2-7b",
    "meta-llama/llama-2-7b-hf": "llama-2-7b",
    "llama3-8b": "llama-3-8b",
    "meta-llama/meta-llama-3-8b": "llama-3-8b",
    "llama3-70b": "llama-3-70b",
    "meta-llama/meta-llama-3-70b": "llama-3-70b",
    "mistral-7b-v0.1": "mistral-7b",
    "mistralai/mistral-7b-v0.1": "mistral-7b",
    "qwen2.5-7b": "qwen2.5-7b",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
    "deepseek-ai/deepseek-v3": "deepseek-v3",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m",
}
"""Other spellings (lower case) of the keys of :data:`ARCHITECTURES`."""
