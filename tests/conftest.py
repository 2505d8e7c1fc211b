import sys
from pathlib import Path

# Test helpers (stack.py, openai_spec.py) import as top-level modules.
sys.path.insert(0, str(Path(__file__).resolve().parent))
