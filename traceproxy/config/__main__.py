"""python -m traceproxy.config > config/traceproxy.toml
python -m traceproxy.config reference > docs/configuration.md"""

import sys

from .render import render_default_toml, render_reference_markdown

print(render_reference_markdown() if sys.argv[1:] == ["reference"] else render_default_toml(), end="")
