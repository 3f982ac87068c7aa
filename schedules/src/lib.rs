//! Pipeline schedules as data (being written).
#![deny(missing_docs)]
