"""``miles dashboard``: a read-only local web page over one or more run directories.

``data`` reads a run (metrics rows, trajectory records, evaluations) and stays current with
``--follow``; ``charts`` turns rows into Plotly traces; ``app`` serves the pages (FastAPI, jinja2
templates and the Plotly bundle shipped by the ``plotly`` package: nothing is fetched at view
time). Everything here imports its web dependencies lazily: the core package does not need them.
"""
