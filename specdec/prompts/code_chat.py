"""More programming questions for distillation (`distill_code_chat.jsonl`'s later lines): the kind of chat the
pair benchmark asks, from templates over topics that are none of its held-out prompts' (processes and threads,
decorators, binary search, readable code). Answered at ANSWER_TOKENS, the length the pair benchmark's chat runs to.

    python -m specdec.prompts.code_chat >> specdec/prompts/distill_code_chat.jsonl   (once: lines already there are
    skipped)
"""
import json
import sys

from . import HERE, load_prompts

ANSWER_TOKENS = 128
HELD_OUT_TOPICS = ("process", "thread", "decorator", "binary search", "readable")

CONCEPTS = """a closure|a generator expression|a list comprehension|a dict comprehension|a set|a frozenset|a namedtuple|
a dataclass|a property|a class method|a static method|an abstract base class|a metaclass|a descriptor|
duck typing|type hints|a Protocol in typing|a TypedDict|the walrus operator|f-strings|slicing|unpacking|
*args and **kwargs|keyword-only arguments|default mutable arguments|the with statement|exception chaining|
a custom exception|the finally clause|assertions|the __init__ method|the __repr__ method|operator overloading|
the __slots__ attribute|the iterator protocol|itertools.groupby|functools.partial|functools.lru_cache|
collections.Counter|collections.defaultdict|collections.deque|heapq|bisect|the enum module|the pathlib module|
the argparse module|the subprocess module|the json module|the csv module|the re module|regular expression groups|
the datetime module|time zones in Python|the logging module|virtual environments|pip and requirements files|
pyproject.toml|a Python package|a relative import|circular imports|the __name__ == "__main__" check|
asyncio tasks|async and await|a coroutine|an async context manager|a semaphore|a queue|a deadlock|
a lock|multiprocessing pools|memory leaks in Python|garbage collection|reference counting|weak references|
shallow and deep copies|object identity|hashing of objects|immutability|string interning|Unicode and encodings|
bytes and bytearray|struct packing|memoryview|NumPy broadcasting|NumPy vectorization|a pandas DataFrame|
pandas groupby|a pandas merge|matplotlib subplots|pytest fixtures|pytest parametrize|mocking in tests|
test coverage|property-based testing|a linked list|a doubly linked list|a stack|a binary tree|a binary search tree|
an AVL tree|a red-black tree|a trie|a graph adjacency list|a priority queue|a hash map collision|a bloom filter|
a union-find structure|a segment tree|dynamic programming|a greedy algorithm|backtracking|divide and conquer|
merge sort|quicksort|insertion sort|counting sort|Dijkstra's algorithm|A* search|depth-first search|
the two-pointer technique|a sliding window|bit manipulation|amortized complexity|space complexity|tail recursion|
a REST API|GraphQL|WebSockets|JSON Web Tokens|OAuth|CORS|HTTP caching|cookies and sessions|a CDN|
a load balancer|rate limiting|idempotency in APIs|pagination in an API|API versioning|gRPC|message queues|
Kafka topics|a cache eviction policy|Redis|database indexes|database transactions|ACID properties|
a foreign key|database normalization|an ORM|SQL window functions|a SQL subquery|a SQL GROUP BY|
a SQL LEFT JOIN|a database migration|connection pooling|sharding|replication|eventual consistency|
the CAP theorem|microservices|a monolith|dependency injection|the observer pattern|the strategy pattern|
the adapter pattern|the builder pattern|the repository pattern|SOLID principles|the single responsibility principle|
composition over inheritance|immutability in functional programming|pure functions|higher-order functions|
map, filter and reduce|currying|a lambda function|Git rebase|Git merge conflicts|Git stash|Git tags|
a pull request|continuous integration|a Dockerfile|Docker volumes|Docker Compose|Kubernetes pods|
environment variables|a Makefile|semantic versioning|a shell pipe|file permissions in Linux|cron jobs|
SSH keys|the PATH variable|a JavaScript promise|JavaScript closures|the JavaScript event loop|let and const|
arrow functions|TypeScript interfaces|TypeScript generics|React hooks|React state|the virtual DOM|
CSS flexbox|CSS grid|a Rust borrow checker|Rust ownership|Rust lifetimes|Rust traits|Go goroutines|
Go channels|Go interfaces|C pointers|C structs|memory allocation in C|a segmentation fault|Java generics|
the Java virtual machine|Java streams|garbage collection in Java|a hash function|a checksum|UTF-8|
floating-point rounding|integer overflow|a bitmask|endianness|a mutex|a spinlock|a thread pool|
a futures executor|backpressure|a circuit breaker|retries with exponential backoff|logging levels|
structured logging|profiling Python code|a memory profiler|a benchmark|caching with memoization|
lazy evaluation|a code smell|refactoring|technical debt|code coverage|a linter|a code formatter|type checking
with mypy|static analysis|fuzz testing|integration tests|end-to-end tests|test doubles|a build system|
a package manager|a lock file|a monorepo|feature flags|blue-green deployment|a canary release|
infrastructure as code|a reverse proxy|TLS certificates|hashing passwords|SQL injection|cross-site scripting|
input validation|a buffer overflow|a race in a web app|an N+1 query problem|a deadlock in a database"""

COMPARISONS = [
    ("a list", "a set"), ("a dict", "a list of pairs"), ("== ", "is"), ("append", "extend"), ("sort", "sorted"),
    ("a shallow copy", "a deep copy"), ("a module", "a package"), ("a class attribute", "an instance attribute"),
    ("__str__", "__repr__"), ("a generator", "a list"), ("yield", "return"), ("an iterator", "an iterable"),
    ("a tuple", "a namedtuple"), ("a dataclass", "a dict"), ("abs", "math.fabs"), ("json.load", "json.loads"),
    ("pickle", "JSON"), ("asyncio", "multiprocessing"), ("async code", "synchronous code"),
    ("a queue", "a stack"), ("BFS", "DFS"), ("merge sort", "quicksort"), ("an array", "a linked list"),
    ("a hash table", "a balanced tree"), ("recursion", "iteration"), ("a heap", "a sorted list"),
    ("SQL", "NoSQL"), ("INNER JOIN", "LEFT JOIN"), ("WHERE", "HAVING"), ("DELETE", "TRUNCATE"),
    ("a primary key", "a unique key"), ("PostgreSQL", "SQLite"), ("REST", "GraphQL"), ("GET", "POST"),
    ("PUT", "PATCH"), ("HTTP", "HTTPS"), ("TCP", "UDP"), ("cookies", "local storage"),
    ("authentication", "authorization"), ("encryption", "hashing"), ("git merge", "git rebase"),
    ("git reset", "git revert"), ("git fetch", "git pull"), ("a fork", "a branch"), ("Docker", "a virtual machine"),
    ("an image", "a container"), ("CMD", "ENTRYPOINT in a Dockerfile"), ("unit tests", "integration tests"),
    ("a mock", "a stub"), ("let", "var in JavaScript"), ("== ", "=== in JavaScript"), ("null", "undefined"),
    ("a promise", "a callback"), ("TypeScript", "JavaScript"), ("an interface", "a type alias in TypeScript"),
    ("React props", "React state"), ("Rust", "C++"), ("Go", "Python for a web service"), ("a struct", "a class"),
    ("the stack", "the heap"), ("malloc", "calloc"), ("a compiler", "an interpreter"),
    ("static typing", "dynamic typing"), ("strong typing", "weak typing"), ("concurrency", "parallelism"),
    ("a mutex", "a semaphore"), ("latency", "throughput"), ("horizontal scaling", "vertical scaling"),
    ("a library", "a framework"), ("an API", "an SDK"), ("a monolith", "microservices"), ("Kafka", "RabbitMQ"),
    ("Redis", "Memcached"), ("a pure function", "a method with side effects"), ("inheritance", "composition"),
    ("an abstract class", "a Protocol in Python"), ("pip", "conda"), ("venv", "a Docker image"),
    ("float", "Decimal in Python"), ("str.format", "f-strings"), ("os.path", "pathlib"), ("map", "a comprehension"),
]

TASKS = """counts the vowels in a string|removes duplicates from a list and keeps
the order|flattens a nested list|checks whether two strings are anagrams|finds the second largest number in a
list|merges two sorted lists|rotates a list by k positions|returns the n-th Fibonacci number|checks whether a
number is prime|computes the greatest common divisor of two numbers|converts a decimal number to binary|converts
Celsius to Fahrenheit|finds the most common word in a text|splits a list into chunks of size n|transposes a
matrix|validates an email address with a regular expression|parses a date string into a datetime|computes the
median of a list|groups a list of dicts by a key|sorts a list of dicts by two keys|finds all pairs in a list that
sum to a target|checks whether brackets in a string are balanced|compresses a string with run-length
encoding|computes a moving average|counts the lines in a file|reads a JSON file and prints its keys|writes a list
of dicts to a CSV file|finds the longest common prefix of a list of strings|checks whether a string is a valid
IPv4 address|generates a random password|retries a function call up to three times|measures how long a function
takes|memoizes an expensive function|downloads a web page with urllib|walks a directory tree and lists Python
files|renames files to lower case|deep-merges two dictionaries|converts a nested dict to a flat dict with dotted
keys|implements a simple LRU cache|implements a stack with a list|implements a queue with two stacks|finds the
intersection of two lists|returns the k largest items of a list|checks whether a linked list has a cycle|reverses
a linked list|computes the depth of a binary tree|serializes a binary tree to a list|finds the shortest path in a
grid|counts the islands in a grid|computes the edit distance of two strings|finds the longest increasing
subsequence|computes all permutations of a string|computes all subsets of a set|formats a number with thousands
separators|converts a Roman numeral to an integer|converts an integer to a Roman numeral|checks whether a year is
a leap year|computes the day of the week for a date|parses command-line arguments for a file name and a
count|reads environment variables with defaults|logs messages to a file and the console|parses a query string
into a dict|builds a URL with query parameters|times out a slow function call|runs two functions
concurrently with asyncio|processes a list in parallel with a pool|hashes a file with SHA-256|compares two
files line by line|tails the last n lines of a file|pretty-prints a table of data|truncates a string to n
characters with an ellipsis|wraps text at 80 columns|capitalizes the first letter of each sentence|strips HTML
tags from a string|counts word frequencies with Counter|finds duplicate files by content|checks whether a
number is a power of two|computes the factorial of a number iteratively|clamps a value to a range|interleaves two
lists|zips two lists into a dict|inverts a dictionary|finds the mode of a list|normalizes a list of numbers to
the range 0 to 1|computes the dot product of two vectors|multiplies two matrices|checks whether a matrix is
symmetric|generates Pascal's triangle|prints a multiplication table|converts snake_case to camelCase|converts
camelCase to snake_case|checks whether a sentence is a pangram|finds the first non-repeating character in a
string|shuffles a list in place|samples k items from a stream|computes a histogram of values|parses a CSV line
with quoted fields|validates a password's strength|masks all but the last four digits of a card number"""

LANGUAGES = ("JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "Bash", "SQL")
LANGUAGE_TASKS = """reverses a string|finds the maximum of an array|counts the words in a string|reads a file line by
line|checks whether a number is even|sums the numbers in a list|removes duplicates from an array|sorts an array
of objects by a field"""

ACTIVITIES = """naming variables|writing commit messages|writing docstrings|structuring a Python project|writing
unit tests|debugging a crash|reviewing a pull request|speeding up slow Python code|learning a new programming
language|preparing for a coding interview|writing SQL queries|designing a REST API|handling errors in
Python|logging in production|securing a web application|working with legacy code|pair programming|writing
a README|choosing a database|using Git in a team|writing shell scripts|profiling memory use|writing
asynchronous code|designing a class hierarchy|keeping dependencies up to date|deploying a Python
app|documenting an API|writing a command-line tool|organizing tests|handling dates and times"""

CONCEPT_FORMS = ("Explain {} with a short example.", "What is {}, and when would I use it?",
                 "What are common mistakes with {}?", "How does {} work?", "Explain {} to a beginner.",
                 "What problem does {} solve?", "When should I avoid {}?")
COMPARISON_FORMS = ("What is the difference between {} and {}?", "When would I choose {} over {}?")
TASK_FORMS = ("Write a Python function that {}.", "How would you write code that {}? Keep it short.")


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.replace("\n", " ").split("|") if t.strip()]


def questions() -> list[str]:
    """Every templated question, in a fixed order, none about a held-out topic nor a shipped held-out prompt."""
    out = [f.format(t) for i, t in enumerate(_split(CONCEPTS))
           for f in (CONCEPT_FORMS[i % 7], CONCEPT_FORMS[(i + 3) % 7], CONCEPT_FORMS[(i + 5) % 7])]
    out += [f.format(a.strip(), b) for a, b in COMPARISONS for f in COMPARISON_FORMS]
    out += [f.format(t) for t in _split(TASKS) for f in TASK_FORMS]
    out += [f"Write a {lang} function that {t}." for i, t in enumerate(_split(LANGUAGE_TASKS))
            for lang in LANGUAGES[i % 3::3]]
    out += [f"Give me three tips for {a}." for a in _split(ACTIVITIES)]
    out += [f.format(t) for i, t in enumerate(_split(CONCEPTS))  # (a later batch: two more forms a concept)
            for f in (CONCEPT_FORMS[(i + 1) % 7], CONCEPT_FORMS[(i + 6) % 7])]
    held = {p["prompt"] for p in load_prompts()}
    return [q for q in dict.fromkeys(out) if q not in held and not any(w in q.lower() for w in HELD_OUT_TOPICS)]


def main() -> None:
    have = {json.loads(line)["prompt"] for line in (HERE / "distill_code_chat.jsonl").read_text().splitlines()
            if line.strip()}
    for q in questions():
        if q not in have:
            sys.stdout.write(json.dumps({"prompt": q, "mode": "chat", "max_new_tokens": ANSWER_TOKENS}) + "\n")


if __name__ == "__main__":
    main()
