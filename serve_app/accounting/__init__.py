"""What was used and what it cost: usage, reports, prices, final records, the audit trail, storage accounts."""
