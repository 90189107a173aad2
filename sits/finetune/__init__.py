"""LoRA fine-tuning: a job that trains an adapter on a dataset folder, snapshots its whole state as it
goes (so a restarted job resumes where it was), and hands the adapter to a serving unit when done."""
