"""Training and evaluation data: records and chats tokenised into samples, eval splits, capacity fits."""
