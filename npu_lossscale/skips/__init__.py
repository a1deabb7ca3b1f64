"""Skip conditions (``seams.SkipCondition``) after the overflow check:
steps asked to be skipped (``requested``), and loss spikes
(``loss_spikes``)."""
