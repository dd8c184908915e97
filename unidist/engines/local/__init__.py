"""One process, no launcher (``python script.py``): its record and Manager."""
