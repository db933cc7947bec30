"""Fast tests of one module or a few, in one process: no S3 server, no node processes."""
