"""What every script and package shares at its edges, below data/ and model/: the expected
failures (errors.py), the CLI edge that names them in one line and checks flags (cli.py), JSON
Lines read and written strictly (jsonl.py), the rules for writing outputs atomically and only
over this project's own (outputs.py), and a child process that dies with its parent (procs.py).
A leaf package: it imports the standard library and third-party packages only, never the
project's, so any script or package may import it without pulling in the pipeline or closing an
import cycle (tests/test_imports.py checks this)."""
