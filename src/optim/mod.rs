//! Optimizers and learning-rate schedules (being written).
