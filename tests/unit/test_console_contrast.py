"""The console's colour pairs meet WCAG 2.1 AA contrast (4.5:1 for text)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.console.render import money, when

CSS = (Path(__file__).resolve().parents[2] / "web" / "static" / "console.css").read_text()
AA_TEXT = 4.5


def variable(name: str) -> str:
    match = re.search(rf"--{name}:\s*(#[0-9a-fA-F]{{6}})", CSS)
    assert match is not None, f"--{name} is not a 6-digit colour in console.css"
    return match.group(1)


def luminance(colour: str) -> float:
    def channel(hex_pair: str) -> float:
        c = int(hex_pair, 16) / 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(colour[i : i + 2]) for i in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: str, b: str) -> float:
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


@pytest.mark.parametrize(
    ("text", "background"),
    [
        ("ink", "bg"),
        ("ink", "card"),
        ("muted", "card"),
        ("muted", "bg"),
        ("accent", "card"),
        ("accent-ink", "accent"),
        ("danger", "card"),
        ("ok", "card"),
    ],
)
def test_text_colours_meet_aa(text: str, background: str) -> None:
    assert contrast(variable(text), variable(background)) >= AA_TEXT


def test_header_and_flash_colours_meet_aa() -> None:
    assert contrast("#ffffff", "#102a43") >= AA_TEXT  # header links
    assert contrast("#0d4a1f", "#e6f4ea") >= AA_TEXT  # success notice
    assert contrast("#7a1a14", "#fce8e6") >= AA_TEXT  # error notice
    assert contrast("#ffffff", variable("danger")) >= AA_TEXT  # revoke button


def test_money_and_time_formatting() -> None:
    assert money(None) == "unlimited"
    assert money(25_500_000) == "$25.50"
    assert money(1_445) == "$0.001445"
    assert money(1_234_000_000) == "$1,234.00"
    assert when(None) == "never"
