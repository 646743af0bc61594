"""What the ranks of one group must agree on before their first collective.

Ranks started apart (torchrun on several machines) may be given different settings or
files: another partition method (`auto` resolves by what each machine has installed), a
dataset or model copied differently, precomputed embeddings on some machines only. Their
collectives then go out of step and every rank waits until the group's timeout, again at
each restart. So each rank states its identity (a small dict of strings and ints, computed
once at start), the ranks all-gather them, and every rank raises the same one-line
ConfigError naming each field that differs and which ranks hold which value.
"""

from __future__ import annotations

import torch.distributed as dist

from hybridgnn.errors import ConfigError

MAX_VALUES = 4  # distinct values named per field; the rest are counted


def _ranks(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 0-2, 5': runs of consecutive ranks as ranges."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def _value(v) -> str:
    return "none" if v is None else repr(v)


def disagreements(identities: list[dict]) -> list[str]:
    """One text per field on which the ranks' identities (identities[r]: rank r's) differ,
    in the order rank 0 lists its fields: "partition 'metis' on rank 0, 'ranges' on
    ranks 1-3". Empty when they all agree."""
    fields = list(dict.fromkeys(k for ident in identities for k in ident))
    out = []
    for field in fields:
        holders: dict = {}  # value -> the ranks holding it, in order of the first holder
        for rank, ident in enumerate(identities):
            holders.setdefault(_value(ident.get(field)), []).append(rank)
        if len(holders) < 2:
            continue
        named = [f"{v} on {_ranks(rs)}" for v, rs in list(holders.items())[:MAX_VALUES]]
        if len(holders) > MAX_VALUES:
            named.append(f"{len(holders) - MAX_VALUES} other values")
        out.append(f"{field} {', '.join(named)}")
    return out


def disagreement_error(identities: list[dict], what: str, hint: str) -> ConfigError | None:
    """The ConfigError every rank raises when the identities differ (None when they agree).
    what: the group ("partition ranks"); hint: what to give every rank alike."""
    differ = disagreements(identities)
    if not differ:
        return None
    return ConfigError(f"the {len(identities)} {what} do not agree on {'; '.join(differ)}: {hint}")


def check_agreement(mine: dict, what: str, hint: str) -> None:
    """Collective, and the group's first: ConfigError on every rank unless every rank's
    identity equals this one's. Under NCCL the rank's GPU must be current (set before
    the group was joined), as all_gather_object moves its bytes through it."""
    identities: list = [None] * dist.get_world_size()
    dist.all_gather_object(identities, mine)
    error = disagreement_error(identities, what, hint)
    if error is not None:
        raise error
