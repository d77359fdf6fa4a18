"""The Hugging Face hub, used only where a spec names it (`hf:ORG/NAME`): reachable or not, decided once
and fast, so an offline machine fails in one line instead of after huggingface_hub's retries."""
from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse

from .errors import ModelSpecError, one_line

HUB_PREFIX = "hf:"


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    """Can this process open a connection to the hub? HF_HUB_OFFLINE=1 says no without asking."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def from_hub(load, hub_id: str, what: str, **kwargs):
    """`load(hub_id, **kwargs)` (a from_pretrained); offline, only the local cache is tried. Any failure is
    one line that says how to get the files here."""
    online = hub_reachable()
    try:
        return load(hub_id, local_files_only=not online, **kwargs)
    except OSError as exc:  # transformers' "not found", "no network" and "not cached" alike
        if _gated(exc):
            raise ModelSpecError(f"{HUB_PREFIX}{hub_id} is a gated model: accept its licence on "
                                 f"huggingface.co/{hub_id}, then give a token with access (set HF_TOKEN, or run "
                                 "`hf auth login`)") from exc
        why = "not reachable from here (no network) and not in the local cache" if not online else one_line(exc)[:160]
        raise ModelSpecError(f"cannot load the {what} {HUB_PREFIX}{hub_id} from the Hugging Face hub: {why}; "
                             "check the id, or save_pretrained it where there is network and pass the "
                             "folder") from exc


def _gated(exc: BaseException) -> bool:
    """Is huggingface_hub's GatedRepoError (a model whose licence must be accepted, read with a token) behind `exc`?
    transformers wraps it in an OSError of its own, so its causes are followed."""
    for _ in range(8):  # a chain is a few links long; a cycle must not hang the error
        if exc is None:
            return False
        if type(exc).__name__ == "GatedRepoError":  # by name: huggingface_hub is imported only with transformers
            return True
        exc = exc.__cause__ or exc.__context__
    return False
