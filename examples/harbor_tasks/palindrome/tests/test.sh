#!/bin/bash
cd /app && python3 /tests/check.py
