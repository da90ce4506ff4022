"""The bundled instruction set: questions about the Python standard library answered by its own docstrings.

No download and no invented text: for the public functions, classes and methods of the widely used
standard-library modules in `MODULES` (those this Python has), an instruction such as "Explain what
`json.dumps` does." is answered by the first paragraph of the member's docstring, written by the CPython
developers (PSF licence). There are a few phrasings per kind of member, one of them with the call
signature as the input; a hash of the member's name picks the phrasing, so the same Python gives the same
set on every run. Signature-only paragraphs, outputs under `MIN_OUTPUT_CHARS` or over `MAX_OUTPUT_CHARS`
(so that most examples fit the small presets' rows) and repeated prompts or outputs are left out.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import zlib
from pathlib import Path

from model_core.data.docstrings import stdlib_dir, stdlib_fingerprint

MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "cmd", "code", "codecs", "collections",
    "colorsys", "configparser", "contextlib", "copy", "copyreg", "csv", "dataclasses", "datetime", "difflib",
    "dis", "doctest", "email.message", "email.utils", "enum", "filecmp", "fileinput", "fnmatch", "fractions",
    "ftplib", "functools", "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html",
    "http.client", "http.cookies", "http.server", "imaplib", "inspect", "ipaddress", "json", "json.decoder",
    "json.encoder", "linecache", "locale", "logging", "logging.handlers", "lzma", "mailbox", "mimetypes",
    "netrc", "numbers", "operator", "optparse", "os", "pathlib", "pdb", "pickle", "pkgutil", "platform",
    "plistlib", "pprint", "pstats", "queue", "random", "re", "reprlib", "runpy", "sched", "secrets",
    "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver", "ssl", "statistics",
    "string", "subprocess", "sysconfig", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
    "trace", "traceback", "tracemalloc", "types", "typing", "unittest.case", "urllib.parse", "urllib.request",
    "uuid", "warnings", "wave", "weakref", "webbrowser", "zipapp", "zipfile", "zoneinfo",
)
MIN_OUTPUT_CHARS = 40
MAX_OUTPUT_CHARS = 400

_PHRASINGS = {  # None: the signature is the input
    "module": ("What does the `{name}` module provide?", "Explain what the Python module `{name}` is for."),
    "class": (
        "What is `{name}` for?",
        "Explain the `{name}` class.",
        "Describe what a `{name}` object is in Python's standard library.",
    ),
    "function": (
        "Explain what `{name}` does.",
        "What does `{name}` do in Python?",
        "Describe the standard-library function `{name}`.",
        None,
    ),
    "method": ("Explain what the method `{name}` does.", "What does `{name}` do?", None),
}
_SIGNATURE_INSTRUCTION = "Explain what this function from the Python standard library does."
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_SIGNATURE_LINE = re.compile(r"[\w.]+\([^)]*\)\s*(->|$)")  # `name(args)` or `D.items() -> ...`


def bundled_records() -> list[dict]:
    """The records, in module order then source order, as Alpaca-style dicts."""
    records, prompts, outputs = [], set(), set()
    for module in MODULES:
        path = _module_file(module)
        if path is None:
            continue
        for record in _module_records(module, ast.parse(path.read_bytes(), filename=str(path))):
            prompt = (record["instruction"], record.get("input", ""))
            if prompt in prompts or record["output"] in outputs:
                continue
            prompts.add(prompt)
            outputs.add(record["output"])
            records.append(record)
    return records


def bundled_jsonl() -> bytes:
    """The records as JSONL bytes, read like any instruction file (and hashed to recognise the set)."""
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in bundled_records()).encode()


def _module_file(module: str) -> Path | None:
    base = stdlib_dir().joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _module_records(module: str, tree: ast.Module) -> list[dict]:
    members = [("module", module, tree)]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            members.append((kind, f"{module}.{node.name}", node))
            if kind == "class":
                members += [
                    ("method", f"{module}.{node.name}.{method.name}", method)
                    for method in node.body
                    if isinstance(method, ast.FunctionDef) and not method.name.startswith("_")
                ]
    records = []
    for kind, name, node in members:
        output = _first_paragraph(node)
        if output is not None:
            records.append(_record(kind, name, node, output))
    return records


def _first_paragraph(node: ast.AST) -> str | None:
    docstring = ast.get_docstring(node)
    if not docstring:
        return None
    paragraph = " ".join(_PARAGRAPH_BREAK.split(docstring.strip())[0].split())
    if _SIGNATURE_LINE.match(paragraph):
        return None
    return paragraph if MIN_OUTPUT_CHARS <= len(paragraph) <= MAX_OUTPUT_CHARS else None


def _record(kind: str, name: str, node: ast.AST, output: str) -> dict:
    phrasings = _PHRASINGS[kind]
    phrasing = phrasings[zlib.crc32(name.encode()) % len(phrasings)]
    if phrasing is None:
        signature = _signature(name, node, without_self=kind == "method")
        return {"instruction": _SIGNATURE_INSTRUCTION, "input": signature, "output": output}
    return {"instruction": phrasing.format(name=name), "output": output}


def _signature(name: str, node: ast.FunctionDef, without_self: bool) -> str:
    """`name(parameters)` as written in the source (for a method, without its self or cls)."""
    arguments = node.args
    positional = arguments.posonlyargs or arguments.args
    if without_self and positional and positional[0].arg in ("self", "cls"):
        del positional[0]  # the tree is ours, parsed for this one pass
    return f"{name}({ast.unparse(arguments)})"


def bundled_fingerprint() -> str:
    """Identifies the set without building it: the standard library's fingerprint and this module's source."""
    digest = hashlib.sha256(stdlib_fingerprint().encode())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()
