"""What every stream entry shares (docs/stream-format.md): the format version it carries
and the check a reader makes of it, the types of its fields on the way to Redis and back,
and how a reason for refusing one shows what it refused."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rollstream.shared.errors import FormatError

Fields = dict[str, bytes | str | int | float]
WireFields = dict[str, bytes | str | int | float | tuple[np.ndarray, ...]]
RawFields = Mapping[bytes, bytes]

# docs/stream-format.md: every entry carries "format" = "MAJOR.MINOR". A reader reads
# every minor version of its major (new fields are only ever added), and refuses any
# other major; an entry without the field is from before the field existed: 1.0.
FORMAT_VERSION = "1.0"
FORMAT_MAJOR = FORMAT_VERSION.split(".")[0]
# A group entry with an agent trajectory's fields (a sample's mask, turns, agent status)
# is 1.1; every other entry stays 1.0, byte for byte what it was before 1.1 existed.
TRAJECTORY_FORMAT_VERSION = "1.1"


def check_format(version: bytes | str | None, what: str) -> None:
    """FormatError unless ``version`` (an entry's or the run's "format") is of our major."""
    if version is None:
        return
    text = version.decode("utf-8", "replace") if isinstance(version, bytes) else version
    if text.split(".")[0] != FORMAT_MAJOR:
        raise FormatError(
            f"{what} is in stream format {text!r}; this rollstream reads format {FORMAT_MAJOR}.x "
            "(upgrade rollstream, or use the version that wrote the run)"
        )


def shown(value: object, limit: int = 40) -> str:
    """A value in a reason, cut short: the entry's fields go to the dead letter in full."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reason(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        name = exc.args[0]
        return f"missing field {name.decode() if isinstance(name, bytes) else name!r}"
    return f"{type(exc).__name__}: {exc}"
