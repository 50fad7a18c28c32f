"""The shared filesystem, or a bucket, under the protocol.

Publish by rename and read by open+read (fsio); paths inside the run directory
that never follow a symlink (beneath); node-local directories private to this
user (private_dir); a run directory in a bucket (bucket_url, objstore);
directory operations (trees); the record store (store); binary files read only
as their manifest describes them (verified); wake-up hints (waker); mounts and
the start-up check of a run directory (mounts, storage_check).

May import: the base and records.
"""
