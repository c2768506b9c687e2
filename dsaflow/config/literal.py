"""A resolved config read back as plain values: interpolation markers in its strings are text, never resolved again.

The parent resolves every interpolation once, when it composes (`typed_config`), and writes the plain values to the
run dir's config.yaml. A value that still reads `${...}` there is one the user escaped on purpose
(`'track.run_name=\\${oc.env:SECRET}'`): the worker must see that text, not an environment variable, so before
OmegaConf reads the file back each `${` is escaped. OmegaConf's rule for a string: 2n+1 backslashes before `${` are n
literal backslashes and a literal `${`; so k backslashes before a literal `${` are written as 2k+1.
"""

from __future__ import annotations

import re

_MARKER = re.compile(r"(\\*)\$\{")


def escape_text(text: str) -> str:
    """`text` such that OmegaConf resolves it to exactly `text`."""
    if "${" not in text:
        return text
    return _MARKER.sub(lambda m: "\\" * (2 * len(m.group(1)) + 1) + "${", text)


def literal(data):
    """Parsed YAML (dicts, lists, scalars) with every string escaped (`escape_text`); keys are left as they are."""
    if isinstance(data, str):
        return escape_text(data)
    if isinstance(data, dict):
        return {k: literal(v) for k, v in data.items()}
    if isinstance(data, list):
        return [literal(v) for v in data]
    return data
