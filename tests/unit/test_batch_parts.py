"""The Batch API's pure parts: the batch price, the JSONL checks, a line's worst case and
its engine class."""

from __future__ import annotations

import pytest

from gateway.batches.service import _line_tokens
from tenants.batches import batch_lines
from tenants.errors import InvalidInputError
from tenants.files import MalformedLine, parse_jsonl
from tenants.pricing import Price


def test_the_batch_price_takes_the_discount_off_every_rate_rounding_down() -> None:
    assert Price(100_000, 50_001, 400_000).for_batch() == Price(50_000, 25_000, 200_000)
    assert Price(100, 50, 400, 25).for_batch() == Price(75, 37, 300, 25)
    assert Price(100, 50, 400, 0).for_batch() == Price(100, 50, 400, 0)


def test_a_malformed_line_is_named_by_its_number_blank_lines_counted() -> None:
    assert parse_jsonl(b'{"a": 1}\n\n{"b": 2}\n') == [{"a": 1}, {"b": 2}]
    with pytest.raises(MalformedLine) as bad:
        parse_jsonl(b'{"a": 1}\n\n{"b": \n')
    assert bad.value.line == 3 and "line 3" in str(bad.value)
    with pytest.raises(MalformedLine, match="line 1"):
        parse_jsonl(b"[1, 2]\n")


def test_lines_need_a_unique_custom_id_the_batch_url_and_a_body() -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}
    assert [n.custom_id for n in batch_lines([line], "/v1/completions")] == ["a"]
    for bad, reason in [
        ([line, line], "not unique"),
        ([{**line, "url": "/v1/embeddings"}], "url must be"),
        ([{**line, "method": "GET"}], "method"),
        ([{**line, "body": []}], "body"),
        ([{**line, "custom_id": ""}], "custom_id"),
        ([], "no request"),
    ]:
        with pytest.raises(InvalidInputError, match=reason):
            batch_lines(bad, "/v1/completions")


def test_a_lines_worst_case_is_its_prompt_in_characters_and_all_it_may_ask_for() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "n": 2}
    prompt, output = _line_tokens(chat, "/v1/chat/completions", 100)
    assert prompt == len('[{"role": "user", "content": "hi"}]') and output == 20
    assert _line_tokens({"prompt": "x" * 500}, "/v1/completions", 100) == (100, 99)
    assert _line_tokens({"input": "abc"}, "/v1/embeddings", 100) == (5, 0)
