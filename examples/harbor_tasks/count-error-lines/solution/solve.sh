#!/bin/bash
awk '$2 == "ERROR"' /app/app.log | wc -l > /app/error_count.txt
