"""Running a Plan: stage parts on devices, data routing, collectives, coordinator and workers."""
