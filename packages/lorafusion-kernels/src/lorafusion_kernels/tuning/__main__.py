"""``python -m lorafusion_kernels.tuning`` is ``lorafusion-tune``."""

from __future__ import annotations

import sys

from lorafusion_kernels.tuning.cli import main

sys.exit(main())
