"""PostgreSQL: connections and migrations, bulk writes, per-model vector tables, locks, history and status."""
