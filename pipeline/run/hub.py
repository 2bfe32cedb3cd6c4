"""`--hf-checkpoint` as a Hugging Face Hub id: reachable, cached, or one clear line at once.

Loading a Hub id through transformers when the Hub cannot be reached retries every file request
with backoff: 51 s and 44 retry lines before its one line of error. So before anything loads, the
run asks the Hub once, with a short deadline: a Hub that answers lets transformers download as it
does; a Hub that does not is said in one line, unless the model is in the local Hugging Face
cache, which the run then loads from (its folder, so nothing later asks the Hub either). With
`HF_HUB_OFFLINE` set nothing is asked: the cache has the model or the run stops.
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog

from core.errors import ConfigError

__all__ = ["HUB_DEADLINE", "checkpoint_path"]

log = structlog.get_logger("launch")

HUB_DEADLINE = 5.0  # seconds for the one question to the Hub: a name that does not resolve fails at once


def checkpoint_path(name: str) -> Path:
    """The model `--hf-checkpoint=name` names, as the run loads it: a local folder as given; a Hub
    id as given when the Hub answers, or its cached copy's folder when it cannot be reached.

    Raises ConfigError, in one line, when it is neither a local folder nor a model the Hub or the
    cache can give, naming the Hub's address and the fix."""
    given = Path(name)
    if given.exists():
        return given
    from huggingface_hub import constants

    cached = _cached_folder(name, constants.HF_HUB_CACHE)
    shown = f"--hf-checkpoint={name!r}: no such local folder"
    if _offline():
        if cached is None:
            raise ConfigError(
                [
                    f"{shown}, and it is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) while "
                    "HF_HUB_OFFLINE is set; download it where the Hub can be reached (hf download "
                    f"{name}) and pass its folder"
                ]
            )
        return given  # transformers finds it in the cache without asking
    answered, why = _ask_hub(name, constants.ENDPOINT)
    if answered:
        return given
    if why is None:  # the Hub answered that it has no such model (or not for us)
        if cached is not None:
            return cached
        raise ConfigError(
            [
                f"{shown}, and the Hugging Face Hub ({constants.ENDPOINT}) has no model {name!r} (or it is "
                "private: log in with `hf auth login`); check the name, or pass a local folder"
            ]
        )
    if cached is not None:
        log.warning(
            "the Hugging Face Hub cannot be reached: the model is loaded from the local cache",
            hub=constants.ENDPOINT,
            reason=why,
            folder=str(cached),
        )
        return cached
    raise ConfigError(
        [
            f"{shown}, not in the Hugging Face cache ({constants.HF_HUB_CACHE}), and the Hub "
            f"({constants.ENDPOINT}) cannot be reached ({why}); download it where the Hub can be reached "
            f"(hf download {name}) and pass its folder"
        ]
    )


def _offline() -> bool:
    from huggingface_hub import constants

    said = (os.environ.get(v, "") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(v.strip().upper() in {"1", "ON", "YES", "TRUE"} for v in said)


def _ask_hub(name: str, endpoint: str) -> tuple[bool, str | None]:
    """(True, None) when the Hub has the model; (False, None) when it answered that it has none
    for us; (False, why) when no answer came (no network, a name that does not resolve, a deadline)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        HfApi(endpoint=endpoint).model_info(name, timeout=HUB_DEADLINE)
    except GatedRepoError:
        return True, None  # there, behind a licence: transformers says what to do
    except RepositoryNotFoundError:
        return False, None
    except HfHubHTTPError:
        return True, None  # it answered (busy, rate-limited): transformers retries what it loads
    except Exception as exc:  # a transport error of the Hub's HTTP client, whichever it uses
        return False, str(exc) or type(exc).__name__
    return True, None


def _cached_folder(name: str, cache: str | Path) -> Path | None:
    """The cached snapshot folder of Hub model `name` (its config.json there), or None."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = try_to_load_from_cache(name, "config.json", cache_dir=cache)
    except HFValidationError:  # not a Hub id at all
        return None
    return Path(found).parent if isinstance(found, str) else None
