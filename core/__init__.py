"""The vocabulary every room speaks: samples, groups, batches and their per-token columns
(`types`, `columns`), the one exception tree (`errors`) and the version clock (`clock`).

The ground floor: it imports nothing of the project, so any room can import it without pulling
in another. Users import these names from `pipeline`, which re-exports them.
"""
