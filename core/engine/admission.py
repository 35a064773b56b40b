"""What a request must satisfy before an engine takes it: a prompt of valid token ids that fits
the context and the KV pool, and sampling values within the engine's limits. Each problem is a
:class:`~specdec.errors.RequestError` naming the field (the server turns it into a 400)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import RequestError
from ..sampling import SamplingParams


def checked_prompt(prompt_token_ids: Sequence[int], vocab_size: int, max_model_len: int, block_size: int,
                   num_blocks: int) -> np.ndarray:
    """The prompt as an int64 array, or a :class:`RequestError` naming what is wrong."""
    vocab = vocab_size
    try:
        prompt_ids = np.asarray(prompt_token_ids, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        raise RequestError("prompt", f"token ids must be integers in [0, {vocab})") from None
    if prompt_ids.ndim != 1 or len(prompt_ids) == 0:
        raise RequestError("prompt", "must hold at least one token")
    if len(prompt_ids) >= max_model_len:
        raise RequestError("prompt", f"{len(prompt_ids)} tokens do not fit the context of {max_model_len} "
                                     f"tokens", code="context_length_exceeded")
    if prompt_ids.min() < 0 or prompt_ids.max() >= vocab:
        raise RequestError("prompt", f"token ids must lie in [0, {vocab})")
    blocks = -(-(len(prompt_ids) + 1) // block_size)
    if blocks > num_blocks:
        raise RequestError("prompt", f"{len(prompt_ids)} tokens need {blocks} KV blocks; the pool has "
                                     f"{num_blocks} (raise num_kv_blocks or kv_cache_memory_gb)")
    return prompt_ids


def check_sampling(sampling: SamplingParams, num_prompt_tokens: int, vocab_size: int, max_model_len: int,
                   max_stop_strings: int, max_stop_string_length: int) -> None:
    """Check ``sampling`` against the engine (``SamplingParams`` checked the rest when it was
    built): ``top_k`` within the vocabulary, the stop-string limits, and the context, as the
    OpenAI API counts it (the prompt plus ``max_tokens`` must fit).

    :raises RequestError: naming the field."""
    vocab = vocab_size
    if sampling.top_k > vocab:
        raise RequestError("top_k", f"must be between 0 and {vocab} (the vocabulary size), or -1, "
                                    f"got {sampling.top_k}")
    for field, ids in (("logit_bias", [token for token, _ in sampling.logit_bias]),
                       ("stop_token_ids", sampling.stop_token_ids)):
        if ids and max(ids) >= vocab:
            raise RequestError(field, f"token ids must lie in [0, {vocab}) (the vocabulary), got {max(ids)}")
    stops = sampling.stop
    if len(stops) > max_stop_strings:
        raise RequestError("stop", f"at most {max_stop_strings} stop strings (max_stop_strings), "
                                   f"got {len(stops)}")
    longest = max(stops, key=len, default="")
    if len(longest) > max_stop_string_length:
        raise RequestError("stop", f"a stop string may have at most {max_stop_string_length} "
                                   f"characters (max_stop_string_length), got {len(longest)}")
    if num_prompt_tokens + sampling.max_tokens > max_model_len:
        raise RequestError(
            "max_tokens", f"the context holds {max_model_len} tokens, but the prompt's {num_prompt_tokens} "
                          f"plus max_tokens {sampling.max_tokens} would need {num_prompt_tokens + sampling.max_tokens};"
                          f" lower max_tokens to at most {max_model_len - num_prompt_tokens}",
            code="context_length_exceeded")
