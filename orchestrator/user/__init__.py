"""What a user touches: the job spec, the command line, the Python client, progress and plans."""
