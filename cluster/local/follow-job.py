"""Print a Ray job's output as it comes, then exit 0 if the job succeeded, else 1: `ray job logs --follow` without
the job client's own lines (server address, status banners, the logs repeated on failure), which it prints on
stdout too. Usage: python cluster/local/follow-job.py <dashboard address> <submission id>."""
import asyncio
import logging
import sys

from ray.job_submission import JobStatus, JobSubmissionClient


async def follow(client: JobSubmissionClient, job: str) -> None:
    async for lines in client.tail_job_logs(job):
        sys.stdout.write(lines)
        sys.stdout.flush()


def main(address: str, job: str) -> int:
    logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)  # its INFO: "WebSocket closed"
    client = JobSubmissionClient(address)
    asyncio.run(follow(client, job))
    status = client.get_job_status(job)
    if status != JobStatus.SUCCEEDED:
        print(f"Ray job {job}: {status}", file=sys.stderr)
    return 0 if status == JobStatus.SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
