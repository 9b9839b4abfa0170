"""``lmdock generate``'s token flags on stories260K (hf): honoured as the server honours the same fields."""

from __future__ import annotations

import json
from typing import Any

import pytest
from lmdock._cli.main import main
from stories_facts import GREEDY_40, PROMPT, stories_path


def _ids(capsys: pytest.CaptureFixture[str], *flags: str) -> list[int]:
    assert main(["generate", "-m", stories_path(), "--backend", "hf", "--temperature", "0", "--max-tokens", "6", "--json",
                 *flags, PROMPT]) == 0
    out: Any = json.loads(capsys.readouterr().out)
    return out[0]["outputs"][0]["token_ids"]  # type: ignore[no-any-return]


def test_logit_bias_and_allowed_token_ids_flags_are_honoured(capsys: pytest.CaptureFixture[str]) -> None:
    assert _ids(capsys) == GREEDY_40[:6]
    banned = _ids(capsys, "--logit-bias", f"{GREEDY_40[0]}=-100")
    assert banned[0] != GREEDY_40[0] and GREEDY_40[0] not in banned
    assert set(_ids(capsys, "--allowed-token-ids", "383,286", "--allowed-token-ids", "261")) <= {383, 286, 261}
    assert _ids(capsys, "--logit-bias", "286=100") == [286] * 6
