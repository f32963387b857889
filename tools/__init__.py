"""build.py's parts: `common` (errors, logging, names, zip entries) and `upstream` (the lock,
the package index, the overlay's files), which build.py and the commands `bundle` and `rebase`
import; nothing here imports build.py."""
