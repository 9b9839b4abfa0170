"""Facts about stories260K from ../shared/models/README.md, shared by the tests."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

#: Facts from ../shared/models/README.md (an outside reference: it agrees with llama2.c's C engine).
PROMPT = "Once upon a time"
PROMPT_IDS = [1, 403, 407, 261, 378]
GREEDY_40 = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408,
             419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426]
GREEDY_40_TEXT = ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball."
