"""Instruction records for LoRA fine-tuning: reading them from JSONL, and turning them into token ids with
a loss mask that covers exactly the responses.

Records, one JSON object per line:
  Alpaca style   {"instruction": str, "input": str (optional; "" means none), "output": str}
  conversation   {"messages": [{"role": "user", "content": str}, {"role": "assistant", "content": str}, ...]}
A conversation alternates user and assistant, starts with the user and ends with the assistant; each
(user, assistant) pair is one turn, an Alpaca record is a single turn whose response is `output`.
A line that is not such a record (bad JSON, a missing, empty or non-string field, a wrong role) is
reported with its file and line number and skipped.

The template (headers from `LoraParams`; `[...]` only when the turn has an input):

    {instruction_header}\\n{instruction}\\n\\n[{input_header}\\n{input}\\n\\n]{response_header}\\n

is the prompt; the response follows it, then EOS. A turn's tokens are [BOS] + prompt + response + [EOS]
(BOS when data.add_bos), and a conversation is its turns one after another as one example, so later turns
see earlier ones. The loss mask is 1 on response tokens and each turn's EOS, 0 on BOS and prompts.

Prompt pieces and responses are tokenized separately, so the mask boundary is exact: the turn's start
(the instruction header) with SentencePiece's dummy prefix, as a prompt string given to the model is
encoded, everything after it without (it continues the text). Each separator (instruction header,
"\\n\\n" + input header, "\\n\\n" + response header, with their "\\n") must tokenize alone as it does
inside the text around it; a tokenizer that merges across a separator would give a fine-tuned model
prompts it never saw, so that stops the run with an error naming the separator and both token sequences.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from model_core.data.errors import DataPrepError
from model_core.data.sources import FileReport
from model_core.data.tokenizer import encode_documents
from params.schema import LoraParams

ROLES = ("user", "assistant")


@dataclass(frozen=True)
class Turn:
    instruction: str
    input: str  # "" when the turn has none
    response: str


@dataclass(frozen=True)
class Record:
    source: str  # "file:line", for messages about it
    turns: tuple[Turn, ...]


class _Malformed(ValueError):
    """Why one line is not a record."""


def parse_records(path: Path, data: bytes) -> tuple[list[Record], FileReport]:
    """The records of one JSONL file's bytes; malformed lines (1-based) are in the report, not the records."""
    report = FileReport(path)
    records = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        report.records += 1
        try:
            records.append(Record(f"{path}:{number}", _turns(line)))
        except _Malformed as error:
            report.malformed.append((number, str(error)))
    return records, report


def _turns(line: bytes) -> tuple[Turn, ...]:
    try:
        value = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise _Malformed("undecodable bytes (not UTF-8)") from None
    except json.JSONDecodeError as error:
        raise _Malformed(f"invalid JSON ({error.msg})") from None
    if not isinstance(value, dict):
        raise _Malformed(f"a JSON {type(value).__name__}, not an object")
    if "messages" not in value:
        return (Turn(_text(value, "instruction"), _text(value, "input", optional=True), _text(value, "output")),)
    if "instruction" in value or "output" in value:
        raise _Malformed("both 'messages' and Alpaca fields")
    messages = value["messages"]
    if not isinstance(messages, list) or not messages:
        raise _Malformed("'messages' is not a non-empty list")
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role != ROLES[index % 2]:
            raise _Malformed(
                f"messages[{index}] has role {role!r}, not {ROLES[index % 2]!r} (user and assistant alternate, user first)"
            )
    if len(messages) % 2:
        raise _Malformed("the last message is the user's; a conversation ends with an assistant turn")
    contents = [_text(message, "content", f"messages[{index}].") for index, message in enumerate(messages)]
    return tuple(Turn(user, "", assistant) for user, assistant in zip(contents[::2], contents[1::2]))


def _text(value: dict, field: str, where: str = "", optional: bool = False) -> str:
    if field not in value:
        if optional:
            return ""
        raise _Malformed(f"no {where}{field!r} field")
    text = value[field]
    if not isinstance(text, str):
        raise _Malformed(f"{where}{field!r} is {type(text).__name__}, not a string")
    if not optional and not text.strip():
        raise _Malformed(f"{where}{field!r} is empty")
    return text


def separators(lora: LoraParams) -> dict[str, str]:
    """The template's fixed text, by the LoraParams field that sets it."""
    return {
        "instruction_header": f"{lora.instruction_header}\n",
        "input_header": f"\n\n{lora.input_header}\n",
        "response_header": f"\n\n{lora.response_header}\n",
    }


def render_prompt(instruction: str, input: str, lora: LoraParams) -> str:
    """The prompt of one turn (see the module docstring); a model's response should follow it."""
    parts = separators(lora)
    middle = f"{parts['input_header']}{input}" if input else ""
    return f"{parts['instruction_header']}{instruction}{middle}{parts['response_header']}"


class TemplateEncoder:
    """Token ids and loss masks of records under the template, for one tokenizer."""

    def __init__(self, model: bytes, lora: LoraParams, bos_id: int | None, eos_id: int, num_threads: int) -> None:
        self.lora = lora
        self.start = spm.SentencePieceProcessor(model_proto=model)
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(model)
        proto.normalizer_spec.add_dummy_prefix = False  # text that continues a turn gets no leading "▁"
        self.inner = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        self.bos = np.array([] if bos_id is None else [bos_id], dtype=np.int32)
        self.eos = np.array([eos_id], dtype=np.int32)
        self.num_threads = num_threads
        self.separators = separators(lora)
        self.separator_ids = {
            name: self._encode(self.start if name == "instruction_header" else self.inner, [text])[0]
            for name, text in self.separators.items()
        }

    def encode(self, records: list[Record]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The token ids of all records concatenated (int32), the number of tokens of each (int64) and the
        loss mask aligned with the ids (int8)."""
        turns = [turn for record in records for turn in record.turns]
        contents = self._encode(self.inner, [text for t in turns for text in (t.instruction, t.input, t.response)])
        wholes = self._encode(self.start, [render_prompt(t.instruction, t.input, self.lora) + t.response for t in turns])
        ids, mask, lengths = [np.zeros(0, dtype=np.int32)], [np.zeros(0, dtype=np.int8)], []
        index = 0
        for record in records:
            lengths.append(0)
            for turn in record.turns:
                prompt, response = self._turn(record, turn, contents[3 * index : 3 * index + 3], wholes[index])
                ids += [self.bos, prompt, response, self.eos]
                mask += [np.zeros(len(self.bos) + len(prompt), dtype=np.int8), np.ones(len(response) + 1, dtype=np.int8)]
                lengths[-1] += len(self.bos) + len(prompt) + len(response) + 1
                index += 1
        return np.concatenate(ids), np.array(lengths, dtype=np.int64), np.concatenate(mask)

    def _turn(self, record: Record, turn: Turn, contents: list[np.ndarray], whole: np.ndarray):
        """The prompt and response ids of a turn from its pieces' ids, checked against the whole text's."""
        instruction, input_ids, response = contents
        prompt = [self.separator_ids["instruction_header"], instruction]
        if turn.input:
            prompt += [self.separator_ids["input_header"], input_ids]
        prompt = np.concatenate([*prompt, self.separator_ids["response_header"]])
        if not np.array_equal(np.concatenate([prompt, response]), whole):
            self._explain(record, turn, np.concatenate([prompt, response]), whole)
        return prompt, response

    def _encode(self, processor: spm.SentencePieceProcessor, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int32) for ids in encode_documents(processor, texts, self.num_threads)]

    def _explain(self, record: Record, turn: Turn, parts: np.ndarray, whole: np.ndarray) -> None:
        """Raise naming the separator that tokenizes differently in this turn's text than alone."""
        around = [("instruction_header", "", turn.instruction)]
        if turn.input:
            around.append(("input_header", turn.instruction, turn.input))
        around.append(("response_header", turn.input or turn.instruction, turn.response))
        for name, left, right in around:
            processor = self.inner if left else self.start
            left_ids, right_ids = self._encode(self.inner, [left, right])
            in_context = self._encode(processor, [left + self.separators[name] + right])[0]
            if not np.array_equal(in_context, np.concatenate([left_ids, self.separator_ids[name], right_ids])):
                raise DataPrepError(
                    f"{record.source}: the template separator lora.{name} ({self.separators[name]!r}) tokenizes as "
                    f"{self._pieces(self.separator_ids[name])} alone but as "
                    f"{self._pieces(_between(in_context, left_ids, right_ids))} in the text around it; the tokenizer "
                    "merges across the template boundary, so change the header or use a tokenizer that keeps '\\n' "
                    "a piece of its own"
                )
        raise DataPrepError(
            f"{record.source}: the turn tokenizes as {self._pieces(whole)} as one text but as "
            f"{self._pieces(parts)} piece by piece"
        )

    def _pieces(self, ids: np.ndarray) -> list[str]:
        return [self.start.id_to_piece(int(token)) for token in ids]


def _between(tokens: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """`tokens` without the longest prefix shared with `left` and the longest suffix shared with `right`:
    the separator's tokens in context, with any neighbour it merged into."""
    start = _shared_prefix(tokens, left)
    end = len(tokens) - _shared_prefix(tokens[start:][::-1], right[::-1])
    return tokens[start:end]


def _shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    length = min(len(a), len(b))
    differs = np.flatnonzero(a[:length] != b[:length])
    return int(differs[0]) if len(differs) else length
