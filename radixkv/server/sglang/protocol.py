"""SGLang's native ``/generate`` body (``GenerateReqInput`` and its ``sampling_params``), parsed
strictly and mapped onto radixkv's ``SamplingParams``.

Field names, defaults and meanings follow SGLang's docs ("Sampling Parameters", "Native APIs")
and its ``io_struct.GenerateReqInput`` / ``sampling_params.SamplingParams``. Every field SGLang
defines is accepted. Those radixkv implements take any valid value; the others (multimodal input,
LoRA, disaggregation, hidden states, ...) are accepted only at their default (what clients such as
SGLang's frontend and ``bench_serving`` send) and otherwise refused with a 400
``unsupported_parameter`` naming them. A field SGLang does not define is a 400
``unknown_parameter``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict

from radixkv.errors import RequestError
from radixkv.namespace import MAX_CACHE_SALT_CHARS, Namespace, check_cache_salt
from radixkv.sampling.grammar import any_json_ebnf
from radixkv.sampling_params import SamplingParams
from radixkv.server.engine_client import request_error_to_api
from radixkv.server.openai.protocol import APIError

__all__ = [
    "AbortRequest",
    "GenerateRequest",
    "GenerateSamplingParams",
    "OutputOptions",
    "DEFAULT_MAX_NEW_TOKENS",
    "ENGINE_RENAMES",
]

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default ``max_new_tokens``."""

TOP_K_ALL = 1 << 30
"""SGLang's "whole vocabulary" ``top_k`` (its default)."""

ENGINE_RENAMES = {
    "max_tokens": "sampling_params.max_new_tokens",
    "min_tokens": "sampling_params.min_new_tokens",
    "seed": "sampling_params.sampling_seed",
    "grammar": "sampling_params.ebnf",
    "logprobs": "top_logprobs_num",
    "prompt_logprobs": "top_logprobs_num",
    "logprob_start_len": "logprob_start_len",
    "request_id": "rid",
    **{
        f: f"sampling_params.{f}"
        for f in (
            "n", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
            "skip_special_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
            "json_schema", "regex", "structural_tag",
        )
    },
}  # fmt: skip
"""radixkv ``SamplingParams`` field -> the ``/generate`` field that sets it (for a refusal's ``param``)."""


def unsupported(param: str, message: str) -> APIError:
    """A 400 ``unsupported_parameter`` naming ``param``."""
    return APIError(message, param, code="unsupported_parameter")


def _engine_has(name: str) -> bool:
    return name in SamplingParams.__dataclass_fields__


class GenerateSamplingParams(BaseModel):
    """``sampling_params`` of ``/generate`` (SGLang's names and defaults). ``null`` means the
    default, as in SGLang."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: Optional[int] = DEFAULT_MAX_NEW_TOKENS
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    stop_regex: Optional[Union[str, list[str]]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_new_tokens: Optional[int] = None
    n: Optional[int] = None
    beam_width: Optional[int] = None
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
    stream_interval: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = None
    sampling_seed: Optional[int] = None
    custom_params: Optional[dict[str, Any]] = None
    watermark: Optional[dict[str, Any]] = None

    def to_engine(self, prompt_len: int, ctx: int, prompt_param: str) -> tuple[SamplingParams, "OutputOptions"]:
        """The engine's ``SamplingParams`` for a prompt of ``prompt_len`` tokens and the options
        that shape the answer.

        ``max_new_tokens = 0`` (SGLang's "prefill only", e.g. the frontend caching a prefix) runs
        the prompt's prefill with one sampled token that is not returned. ``null`` runs to the end
        of the context.

        Raises:
            APIError: a value out of range (naming ``sampling_params.<field>``), a prompt or
                ``max_new_tokens`` beyond the context (``context_length_exceeded``), or a field
                this server does not implement (``unsupported_parameter``).
        """
        p = "sampling_params."
        for name in ("beam_width", "custom_params", "watermark"):
            if getattr(self, name) is not None:
                raise unsupported(p + name, f"{p}{name} is not supported by radixkv")
        stop_regex = [self.stop_regex] if isinstance(self.stop_regex, str) else (self.stop_regex or [])
        if stop_regex:
            raise unsupported(p + "stop_regex", f"{p}stop_regex is not supported by radixkv (use stop strings)")
        if self.spaces_between_special_tokens is False:
            raise unsupported(
                p + "spaces_between_special_tokens",
                f"{p}spaces_between_special_tokens=false is not supported (radixkv detokenizes as the tokenizer does)",
            )
        if prompt_len >= ctx:
            raise APIError(
                f"{prompt_param} has {prompt_len} tokens; this model's context is {ctx} tokens "
                f"(at most {ctx - 1} prompt tokens, leaving room for one generated token)",
                prompt_param,
                code="context_length_exceeded",
            )
        room = ctx - prompt_len
        want = self.max_new_tokens
        if want is not None and want < 0:
            raise APIError(f"{p}max_new_tokens must be >= 0, got {want}", p + "max_new_tokens")
        if want is not None and want > room:
            raise APIError(
                f"{p}max_new_tokens={want} plus the {prompt_len} prompt tokens exceeds this model's context of "
                f"{ctx} tokens (at most {room} new tokens)",
                p + "max_new_tokens",
                code="context_length_exceeded",
            )
        if self.top_k is not None and (self.top_k == 0 or self.top_k < -1):
            raise APIError(f"{p}top_k must be -1 (disabled) or >= 1, got {self.top_k}", p + "top_k")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise APIError(f"{p}stream_interval must be >= 1, got {self.stream_interval}", p + "stream_interval")
        top_k = -1 if self.top_k is None or self.top_k >= TOP_K_ALL else self.top_k
        kwargs: dict[str, Any] = dict(
            n=1 if self.n is None else self.n,
            max_tokens=room if want is None else max(want, 1),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.sampling_seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
            skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
        )
        optional = {  # engine field: (value, its no-effect value, the request field)
            "presence_penalty": (self.presence_penalty, 0.0, "presence_penalty"),
            "frequency_penalty": (self.frequency_penalty, 0.0, "frequency_penalty"),
            "repetition_penalty": (self.repetition_penalty, 1.0, "repetition_penalty"),
            "min_tokens": (self.min_new_tokens, 0, "min_new_tokens"),
            "logit_bias": (self.logit_bias, None, "logit_bias"),
            "json_schema": (self.json_schema, None, "json_schema"),
            "regex": (self.regex, None, "regex"),
            "grammar": (self.ebnf, None, "ebnf"),
            "structural_tag": (self.structural_tag, None, "structural_tag"),
        }
        for engine_name, (value, neutral, field) in optional.items():
            if value is None or value == neutral or (field in ("json_schema", "regex", "ebnf") and value == ""):
                continue  # SGLang treats "" as unset for the grammar fields
            if not _engine_has(engine_name):
                raise unsupported(p + field, f"{p}{field} is not supported by this radixkv build")
            kwargs[engine_name] = value
        if kwargs.get("json_schema") == ANY_JSON and not {"regex", "grammar", "structural_tag"} & set(kwargs):
            kwargs["grammar"] = any_json_ebnf()  # SGLang's marker: any JSON object or array
            del kwargs["json_schema"]
        if want == 0 and "min_tokens" in kwargs:
            raise APIError(f"{p}min_new_tokens must be <= max_new_tokens=0", p + "min_new_tokens")
        try:
            params = SamplingParams(**kwargs)
        except RequestError as exc:
            raise request_error_to_api(exc, prompt_param, ENGINE_RENAMES) from exc
        opts = OutputOptions(
            zero_tokens=want == 0,
            no_stop_trim=bool(self.no_stop_trim),
            stream_interval=self.stream_interval or 1,
            skip_special_tokens=params.skip_special_tokens,
        )
        return params, opts


ANY_JSON = "$$ANY$$"
"""SGLang's ``json_schema`` for any JSON object or array (xgrammar's built-in JSON grammar)."""


@dataclass(frozen=True)
class OutputOptions:
    """How one prompt's answer is shaped (not the engine's business).

    Attributes:
        zero_tokens: ``max_new_tokens = 0``: the sampled token is dropped (text ``""``,
            ``output_ids []``, ``completion_tokens 0``, finish ``{"type": "length", "length": 0}``).
        no_stop_trim: keep the matched stop string / stop token in ``text`` (SGLang's
            ``no_stop_trim``); by default both are trimmed.
        stream_interval: stream a sample's state at its first token, then every this many new
            tokens, and when it finishes (SGLang's pacing: the first token is not held back).
        skip_special_tokens: the sample's ``skip_special_tokens`` (for trimming a stop token).
    """

    zero_tokens: bool = False
    no_stop_trim: bool = False
    stream_interval: int = 1
    skip_special_tokens: bool = True


# GenerateReqInput fields radixkv accepts at their default only (what SGLang clients send when
# they do not use the feature): name -> default.
_INERT: dict[str, Any] = {
    "session_id": None, "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None,
    "mm_hashes": None, "mm_content_hashes": None, "use_audio_in_video": False, "video_config": None,
    "watermark": None, "token_ids_logprob": None, "return_sampling_mask": None, "sampling_logprobs_mode": None,
    "return_flat_raw_top_logprobs": False, "return_flat_raw_output_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False, "log_metrics": True, "return_hidden_states": False,
    "return_routed_experts": False, "routed_experts_start_len": 0, "return_indexer_topk": False,
    "modalities": None, "session_params": None, "lora_path": None, "lora_id": None,
    "custom_logit_processor": None, "positional_embed_overrides": None, "bootstrap_host": None,
    "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None, "decode_tp_size": None,
    "routed_dp_rank": None, "data_parallel_rank": None, "disagg_prefill_dp_rank": None, "routing_key": None,
    "conversation_id": None, "http_worker_ipc": None, "background": False, "require_reasoning": False,
    "max_thinking_tokens": None, "priority": None, "no_logs": False, "custom_labels": None,
    "return_bytes": False, "return_entropy": False, "external_trace_header": None, "received_time": None,
    "need_wait_for_mm_inputs": None, "num_items_assigned": None, "encoder_urls": None,
    "max_dynamic_patch": None, "min_dynamic_patch": None, "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None, "images_config": None, "mm_processor_kwargs": None,
    "multi_item_delimiter_indices": None, "token_indices_to_pool": None, "kv_hints": None,
}  # fmt: skip


class GenerateRequest(BaseModel):
    """The body of ``POST /generate``: ``text`` or ``input_ids`` (one prompt or a batch), with
    ``sampling_params`` (one for all, or one per prompt) and the output options."""

    model_config = ConfigDict(extra="allow", strict=True)

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[GenerateSamplingParams, list[GenerateSamplingParams]]] = None
    rid: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    return_logprob: Optional[Union[bool, list[bool]]] = None
    logprob_start_len: Optional[Union[int, list[int]]] = None
    top_logprobs_num: Optional[Union[int, list[int]]] = None
    return_text_in_logprobs: Optional[bool] = False
    return_prompt_token_ids: Optional[bool] = False
    extra_key: Optional[str] = None
    cache_salt: Optional[str] = None

    def check_fields(self) -> None:
        """Refuse unknown fields and unimplemented ones set to anything but their default.

        Raises:
            APIError: ``unknown_parameter`` / ``unsupported_parameter`` naming the field.
        """
        for name, value in (self.model_extra or {}).items():
            if name not in _INERT:
                raise APIError(f"{name}: unknown parameter of /generate", name, code="unknown_parameter")
            if value != _INERT[name]:
                raise unsupported(name, f"{name}={value!r} is not supported by radixkv (only {_INERT[name]!r})")

    def prompts(self, tokenizer: Any) -> tuple[list[tuple[str | None, list[int]]], bool, str]:
        """``(prompts, is_batch, prompt_param)``: each prompt's ``(text or None, token ids)``.

        Text is tokenized without added special tokens, as everywhere in radixkv.

        Raises:
            APIError: neither or both of ``text`` and ``input_ids``, or an empty prompt.
        """
        if (self.text is None) == (self.input_ids is None):
            raise APIError(
                "exactly one of text and input_ids is required", "text" if self.text is None else "input_ids"
            )
        if self.text is not None:
            batch = isinstance(self.text, list)
            texts = self.text if batch else [self.text]
            if not texts:
                raise APIError("text must be a non-empty string or list of strings", "text")
            out: list[tuple[str | None, list[int]]] = []
            for t in texts:
                ids = list(tokenizer.encode(t, add_special_tokens=False))
                if not ids:
                    raise APIError("text must not be empty (it has no tokens)", "text")
                out.append((t, ids))
            return out, batch, "text"
        ids_in = self.input_ids or []
        if not ids_in:
            raise APIError("input_ids must be a non-empty list of token ids (or of such lists)", "input_ids")
        batch = isinstance(ids_in[0], list)
        rows = ids_in if batch else [ids_in]
        for row in rows:
            if not row:
                raise APIError("input_ids lists must be non-empty", "input_ids")
        return [(None, list(r)) for r in rows], batch, "input_ids"

    def per_prompt(self, name: str, count: int) -> list:
        """The value of a field that may be given once or per prompt, as a list of ``count``."""
        value = getattr(self, name)
        if isinstance(value, list) and name != "input_ids":
            if len(value) != count:
                raise APIError(f"{name} has {len(value)} entries for {count} prompts", name)
            return list(value)
        return [value] * count

    def sampling_list(self, count: int) -> list[GenerateSamplingParams]:
        """One ``GenerateSamplingParams`` per prompt (defaults when ``sampling_params`` is absent)."""
        sp = self.sampling_params
        if isinstance(sp, list):
            if len(sp) != count:
                raise APIError(f"sampling_params has {len(sp)} entries for {count} prompts", "sampling_params")
            return list(sp)
        return [sp if sp is not None else GenerateSamplingParams()] * count

    def request_ids(self, count: int, batch: bool) -> list[str]:
        """The engine request id of each prompt: ``rid`` (a string for one prompt, a list for a
        batch) or fresh ones."""
        if self.rid is None:
            return [uuid.uuid4().hex for _ in range(count)]
        if isinstance(self.rid, str):
            if batch:
                raise APIError("rid must be a list with one id per prompt for a batch", "rid")
            return [self.rid]
        if len(self.rid) != count or len(set(self.rid)) != count:
            raise APIError(f"rid must hold {count} distinct ids, one per prompt", "rid")
        return list(self.rid)

    def namespace(self, tenant: Optional[str] = None) -> Namespace | None:
        """The prefix-cache namespace: ``Namespace(tenant, salt=cache_salt, extra_key=extra_key)``
        (requests only share cached prefixes with requests of the same tenant, salt and key; an
        empty ``extra_key`` is no key, as in SGLang; none of the three: None, the shared default).
        ``tenant``: the API key's (:func:`radixkv.server.auth.request_namespace` builds it so).

        Raises:
            APIError: 400 naming ``cache_salt`` unless it is None or a non-empty string of at
                most 128 characters (radixkv's rule; SGLang took "" as no salt); 400 naming
                ``extra_key`` when it is longer than 128 characters (the same bound: every
                namespace a cache holds keeps its key in memory).
        """
        try:
            salt = check_cache_salt(self.cache_salt)
        except ValueError as exc:
            raise APIError(str(exc), "cache_salt") from None
        if self.extra_key is not None and len(self.extra_key) > MAX_CACHE_SALT_CHARS:
            raise APIError(
                f"extra_key must be a string of at most {MAX_CACHE_SALT_CHARS} characters, got {len(self.extra_key)} characters",
                "extra_key",
            )
        return Namespace.of(Namespace(tenant, salt, self.extra_key or None))


def field_names() -> set[str]:
    """Every top-level ``/generate`` field radixkv accepts (tests compare it with SGLang's)."""
    return set(GenerateRequest.model_fields) | set(_INERT)


class AbortRequest(BaseModel):
    """``POST /abort_request``'s body: SGLang's ``AbortReq``. ``rid``: the ``/generate`` request
    to abort (its client's ``rid``); ``abort_all``: every unfinished request instead.
    ``finished_reason`` and ``abort_message`` (what SGLang's own callers set) are accepted only
    at their default (null), else a 400 ``unsupported_parameter``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    rid: str = ""
    abort_all: bool = False
    finished_reason: Optional[dict[str, Any]] = None
    abort_message: Optional[str] = None

    def check_fields(self) -> None:
        for name in ("finished_reason", "abort_message"):
            if getattr(self, name) is not None:
                raise unsupported(name, f"{name} is not supported (radixkv's abort reason is its own)")
