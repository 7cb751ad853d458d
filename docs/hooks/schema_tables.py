"""MkDocs hook: fills the field tables of docs/trace-files.md from sharddbg/schema.py, so that the page says
what the code validates. A marker ``<!-- schema table: NAME -->`` becomes a table of the dict ``NAME`` in
sharddbg.schema; ``<!-- schema version -->`` becomes ``SCHEMA_VERSION``. A marker that names nothing in the
schema fails the build."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

MARKER = re.compile(r"<!-- schema (table: (?P<name>[A-Z_]+)|version) -->")
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object",
              type(None): "null"}
_schema = None


def on_config(config):
    global _schema
    # this repository's sharddbg, whichever one the Python running mkdocs has installed
    root = str(Path(config.config_file_path).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    _schema = importlib.import_module("sharddbg.schema")
    return config


def _table(name: str) -> str:
    fields = getattr(_schema, name, None)
    if not isinstance(fields, dict):
        raise ValueError(f"docs: <!-- schema table: {name} --> names no field table in sharddbg/schema.py")
    rows = ["| field | JSON type | meaning |", "|---|---|---|"]
    for field, (types, meaning) in fields.items():
        type_text = " or ".join(JSON_TYPES.get(t, t.__name__) for t in types)
        meaning = meaning.replace("|", "&#124;")
        rows.append(f"| `{field}` | {type_text} | {meaning} |")
    return "\n".join(rows)


def on_page_markdown(markdown, page, config, files):
    def fill(match):
        if match.group("name"):
            return _table(match.group("name"))
        return str(_schema.SCHEMA_VERSION)

    return MARKER.sub(fill, markdown)
