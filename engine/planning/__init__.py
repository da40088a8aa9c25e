"""What a run will do and the memory it needs: `auto` settings decided, the memory planner, the
advice after an out-of-memory step."""
