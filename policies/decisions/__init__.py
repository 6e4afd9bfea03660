"""What a job does next: recovery after an attempt ends, admission from the queue, its budget and deadline."""
