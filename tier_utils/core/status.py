"""A verdict row's vocabulary, declared once: the four statuses and the columns of a verdict table.
`results` builds the rows (`Check`) from it and `display` shows them; neither needs the other for it."""

STATUSES = ("PASS", "WARN", "FAIL", "SKIP")
CHECK_COLUMNS = ["check", "status", "value", "threshold", "detail"]
