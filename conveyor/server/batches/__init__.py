"""OpenAI's Batch API: ``/v1/files`` and ``/v1/batches``, jobs and files kept in SQLite and a files directory under
``--data-dir`` (``store.py``), input files checked line by line (``input_file.py``), and the runner that sends each
line through the server's own endpoint handlers at the lowest priority (``runner.py``)."""
