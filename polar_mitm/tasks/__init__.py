"""Task files and their graders: the JSONL task format, generated task families, SWE-bench
instances and their grading, answer checks, and the `polar-mitm tasks` commands."""
