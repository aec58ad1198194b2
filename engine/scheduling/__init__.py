"""Scheduling: which requests run each step (`scheduler`), the queue they wait in (`waiting_queue`), and the
running sums of the work no step has done yet that the load record reports (`pending_work`)."""
